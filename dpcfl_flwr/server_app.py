"""The ServerApp: validate the run config, build the strategy, run it, write the results."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from .config.settings import ConfigError, ExperimentConfig, parse_run_config
from .flower_compat import batch_object_requests, in_process_grid
from .models import initial_state
from .results.board import BoardWriter, Observers
from .results.recorder import RunRecorder, unused_results_directory
from .strategies import TooFewSilos, build_strategy
from .strategies.checkpoint import checkpoint_path, load_checkpoint
from .strategies.exchange import PollingGrid, RunInterrupted

logger = logging.getLogger("dpcfl_flwr")

app = ServerApp()


def initial_arrays(experiment: ExperimentConfig) -> ArrayRecord:
    """theta_init: the same initial model for every cluster and silo, seeded, or read from
    the run config's ``initial-weights`` file (ConfigError when it is not the model's)."""
    state = initial_state(experiment.model_spec, experiment.seed, experiment.initial_weights)
    if experiment.initial_weights:
        logger.info("theta_init: model %s from %s", experiment.model,
                    Path(experiment.initial_weights).resolve())
    return ArrayRecord(state)


def run_experiment(grid: Grid, experiment: ExperimentConfig) -> dict:
    """Run one experiment on ``grid`` and write its results directory; returns results."""
    resumed = (load_checkpoint(checkpoint_path(experiment), experiment)
               if experiment.resume else None)
    recorder = RunRecorder(Path(experiment.out_dir), experiment, resumed)
    board = BoardWriter.of_run(experiment, resumed.round if resumed else 0)  # None: turned off
    initial = initial_arrays(experiment)
    strategy = build_strategy(experiment, initial, observer=Observers.of(board, recorder))
    if resumed is not None:
        strategy.resume(resumed)
        logger.info("resuming after round %d of %d (%s)", resumed.round,
                    experiment.num_server_rounds, checkpoint_path(experiment))
    batch_object_requests(grid)  # a deployment's objects in a request per batch, not each
    grid = PollingGrid(grid)  # Flower's loop, with replies polled every 50-500 ms, not 3 s
    strategy.discover(grid, experiment.expected_clients, experiment.wait_for_clients,
                      experiment.required_clients)
    result = strategy.start(grid, initial, experiment.num_server_rounds,
                            experiment.round_timeout)
    results = recorder.finish(strategy, result)
    if board is not None:  # flushed every round; a run that dies leaves complete files
        board.close()
    summary = results["summary"]
    minority = summary.get("minority_accuracy")
    balanced = summary.get("mean_balanced_accuracy")
    logger.info("results in %s: mean accuracy %.4f, balanced %s, minority accuracy %s",
                Path(experiment.out_dir).resolve(), summary.get("mean_accuracy") or 0.0,
                "-" if balanced is None else f"{balanced:.4f}",
                "- (no minority cluster)" if minority is None else f"{minority:.4f}")
    return results


@app.main()
def main(grid: Grid, context: Context) -> None:
    _log_to_console()
    try:
        experiment = parse_run_config(context.run_config)
    except ConfigError as exc:
        logger.error("%s", exc)
        raise SystemExit(f"dpcfl: {exc}") from None
    simulated = in_process_grid(grid)
    if not simulated and not experiment.resume:
        experiment = _own_results_directory(experiment)
    try:
        run_experiment(grid, experiment)
    except ConfigError as exc:  # a checkpoint that cannot be resumed, a model not built
        logger.error("%s", exc)
        raise SystemExit(f"dpcfl: {exc}") from None
    except RunInterrupted:
        if not simulated:
            raise
        # Stopped by run_simulation's Ctrl-C handler, which raises it once the engine is
        # down; returning lets Flower shut the engine down at once (an exception costs 3 s).
    except TooFewSilos as exc:
        # In a simulation the exception reaches `dpcfl simulate`, which prints it as its one
        # error line; a deployed ServerApp's own log gets the line before Flower's traceback.
        if not simulated:
            logger.error("%s", exc)
        raise


def _own_results_directory(experiment: ExperimentConfig) -> ExperimentConfig:
    """``experiment`` writing into a directory no earlier run has written to (`dpcfl
    simulate` checks its --out itself; a deployment submits the same out-dir every time)."""
    out = unused_results_directory(experiment.out_dir)
    if out != Path(experiment.out_dir):
        logger.info("%s holds an earlier run's results; this run writes to %s",
                    experiment.out_dir, out)
        experiment = experiment.model_copy(update={"out_dir": str(out)})
    return experiment


def _log_to_console() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
