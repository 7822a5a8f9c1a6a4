"""Running the app in Flower's simulation engine (Ray), from Python or ``dpcfl simulate``.

The same ServerApp and ClientApp as in deployment are loaded by reference through Flower's
simulation runtime. The run config travels the way ``flwr run`` sends it: as the app's
``[tool.flwr.app.config]``, here written to a throw-away app directory, so every virtual
SuperNode sees it in ``context.run_config``.

Ctrl-C (or SIGTERM) stops a simulation within seconds and leaves no Ray process behind: the
ServerApp ends at its next poll (``strategies/exchange.py``), and Flower shuts Ray down as
after a normal run; a silo task that keeps the engine busy longer than
:data:`STOP_GRACE_SECONDS` (or a second signal) gets the engine's processes killed instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import app_pin
from ..config.config_file import load_config, toml_value
from ..config.settings import ExperimentConfig, parse_run_config
from ..flower_compat import run_simulation as run_in_engine
from ..flower_compat import signals_left_to_caller
from ..models import initial_state
from .processes import descendants

SERVER_APP = "dpcfl_flwr.server_app:app"
CLIENT_APP = app_pin.CLIENTAPP

logger = logging.getLogger(__name__)

#: How long a stopped simulation may take to shut Ray down before its processes are killed.
STOP_GRACE_SECONDS = 5.0


class AlreadyFinished(Exception):
    """``--resume`` of a run that completed: there is nothing to do."""


def experiment_to_run(config: Path | None, overrides: Mapping[str, Any], out: Path | None,
                      overwrite: bool, resume: Path | None) -> ExperimentConfig:
    """What ``dpcfl simulate`` runs: a new run in ``out`` (an earlier run there is removed
    only with ``overwrite``: its silos' ledgers would refuse to train again), or (``resume``)
    the continuation of the run in that directory. ValueError in one line when it cannot;
    :class:`AlreadyFinished` when the run to resume completed."""
    if resume is not None:
        return resumed_experiment(resume, config, overrides)
    pairs = dict(overrides)
    if out is not None:
        pairs["out-dir"] = str(out)
    elif "out-dir" not in pairs and (config is None or "out-dir" not in config.read_text()):
        pairs["out-dir"] = time.strftime("results/%Y%m%d-%H%M%S")
    experiment = absolute_paths(load_config(config, pairs))
    short = experiment.too_few_silos()
    if short:
        raise ValueError(short)
    # the model as the server will build it (registry, Opacus' check, trainable prefixes,
    # initial weights): a model that cannot be built is one line here, before Ray starts
    initial_state(experiment.model_spec, experiment.seed, experiment.initial_weights)
    out_dir = Path(experiment.out_dir)
    if (out_dir / "results.json").exists() or (out_dir / "ledgers").exists():
        if not overwrite:
            raise ValueError(f"{out_dir} holds an earlier run (its silos' ledgers would refuse "
                             "to train again); pass --overwrite, another --out, or --resume "
                             f"{out_dir} to continue it")
        shutil.rmtree(out_dir)
    return experiment


def resumed_experiment(directory: Path, config: str | Path | None,
                       overrides: Mapping[str, Any]) -> ExperimentConfig:
    """The run config to continue the run whose results directory is ``directory``: its
    checkpoint's (or ``config``'s, which must agree with it), with ``overrides`` of the keys
    a resumed run may change. :class:`ConfigError` in one line when it cannot resume,
    :class:`AlreadyFinished` when the run completed."""
    from ..strategies.checkpoint import CHECKPOINT, load_checkpoint, read_checkpoint

    results = directory / "results.json"
    if results.exists() and json.loads(results.read_text()).get("complete"):
        raise AlreadyFinished(f"{directory}: the run completed ({results}); nothing to resume")
    path = directory / CHECKPOINT
    saved = read_checkpoint(path)
    where = {"out-dir": str(directory), "resume": True}
    experiment = absolute_paths(
        load_config(config, {**overrides, **where}) if config is not None
        else parse_run_config({**saved.run_config, **overrides, **where}))
    load_checkpoint(path, experiment)  # refuses another run config, naming what differs
    return experiment


def _write_app_dir(directory: Path, experiment: ExperimentConfig) -> None:
    lines = ["[project]", 'name = "dpcfl-flwr-simulation"', 'version = "0.1.0"', "",
             "[tool.flwr.app]", 'publisher = "dpcfl"', "", "[tool.flwr.app.components]",
             f'serverapp = "{SERVER_APP}"', f'clientapp = "{CLIENT_APP}"', "",
             "[tool.flwr.app.config]"]
    for key, value in experiment.to_run_config().items():
        lines.append(f"{key} = {toml_value(value)}")
    (directory / "pyproject.toml").write_text("\n".join(lines) + "\n")


def run_simulation(experiment: ExperimentConfig, *, cpus: int | None = None,
                   verbose: bool = False, ray_address: str | None = None) -> None:
    """Run ``experiment`` with one virtual SuperNode per silo of its topology (tuned or on
    stock Flower, as :mod:`dpcfl_flwr.flower_compat`'s gate decides), each silo's actor
    holding the run config's silo-cpus and silo-gpus. Ray is a local one of ``cpus`` CPUs
    (None: all), or with ``ray_address`` the running cluster there (its resources, not
    ``cpus``); :class:`~.ray_cluster.ClusterError` in one line when it cannot be joined."""
    from ..strategies.exchange import RunInterrupted

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning
    silo = {"num_cpus": experiment.silo_cpus, "num_gpus": experiment.silo_gpus}
    backend: dict[str, Any] = {"client_resources": silo, "init_args": {}}
    if ray_address is None:
        backend["init_args"] = {
            # "local": a new Ray even where `ray start` left its address in /tmp/ray (or
            # RAY_ADDRESS is set), which ray.init would otherwise join, and then refuse num_cpus
            "address": "local",
            "num_cpus": cpus or os.cpu_count() or 1, "include_dashboard": False,
            "logging_level": "DEBUG" if verbose else "ERROR", "log_to_driver": verbose,
            # none unless a silo asks for a share: Ray then counts the machine's own
            **({} if experiment.silo_gpus else {"num_gpus": 0})}
    with tempfile.TemporaryDirectory(prefix="dpcfl-app-") as app_dir, _environment_kept():
        _write_app_dir(Path(app_dir), experiment)
        with _stopped_by_signals() as received:
            if ray_address is not None:
                _join_cluster(ray_address, silo, experiment.ledger_directory(), verbose)
            run_in_engine(num_supernodes=experiment.topology.num_clients,
                          server_app=SERVER_APP, client_app=CLIENT_APP,
                          run_config=experiment.to_run_config(), backend_config=backend,
                          app_dir=app_dir, verbose=verbose)
    if received:
        name = "Ctrl-C" if received[0] == signal.SIGINT else signal.Signals(received[0]).name
        raise RunInterrupted(f"the run was stopped ({name}) and Ray shut down",
                             128 + received[0])


def _join_cluster(address: str, silo: dict[str, float], ledgers: Path, verbose: bool) -> None:
    """Connect to the cluster at ``address`` (Flower's engine then uses it as it is, and
    disconnects at the end) once one of its nodes fits a silo and every node sees the silos'
    ledger directory; on any failure leave Ray disconnected."""
    import ray

    from .ray_cluster import check_fits, check_shared, connect

    connect(address, verbose=verbose)
    try:
        resources = check_fits(silo)
        check_shared(ledgers)
    except BaseException:
        ray.shutdown()
        raise
    logger.info("joined the Ray cluster at %s (CPU %g, GPU %g)", address,
                resources.get("CPU", 0), resources.get("GPU", 0))


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """Give the process its environment variables back after the engine ran: Flower's engine
    leaves PYTHONPATH set to its app directory and this interpreter's paths, which another
    interpreter started later by this process (Debian's python3 for docker-compose) would
    then import this venv's packages from."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[list[int]]:
    """While the block runs, SIGINT (Ctrl-C) or SIGTERM asks the ServerApp to stop, instead
    of raising KeyboardInterrupt or SystemExit in whatever Flower's or Ray's code the main
    thread is in (which left Flower's worker threads logging each running task's Ray error,
    and the ServerApp thread polling on). Yields the signals received."""
    from ..strategies.exchange import stop_requested  # the ServerApp's side (imports torch)

    received: list[int] = []
    stop_requested.clear()
    if threading.current_thread() is not threading.main_thread():  # signals need the main one
        with _server_app_ends():
            yield received
        return
    deadline: list[threading.Timer] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Ray's C++ core reports a SIGTERM before this runs and arms a 3 s alarm that aborts
        # the process (exit status -6, measured); this handler ends the run instead.
        signal.alarm(0)
        received.append(signum)
        if len(received) > 1:
            _kill_engine_and_exit(f"a second {signal.Signals(signum).name}", signum)
        stop_requested.set()
        logger.warning("stopping the run (Ctrl-C again to end it at once)")
        timer = threading.Timer(STOP_GRACE_SECONDS, _kill_engine_and_exit,
                                (f"the engine still ran {STOP_GRACE_SECONDS:g} s after "
                                 f"{signal.Signals(signum).name}", signum))
        timer.daemon = True
        timer.start()
        deadline.append(timer)

    previous = {signum: signal.signal(signum, on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_left_to_caller(), _server_app_ends():
            yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for timer in deadline:
            timer.cancel()


@contextlib.contextmanager
def _server_app_ends() -> Iterator[None]:
    """A failure of the engine itself leaves the ServerApp thread running, and the interpreter
    waits for it before exiting: ask it to stop. After a run that ended by the ServerApp's
    return or exception the request is withdrawn (a later run or strategy in this process
    must not find it)."""
    from ..strategies import TooFewSilos
    from ..strategies.exchange import stop_requested

    try:
        yield
    except TooFewSilos:
        stop_requested.clear()
        raise
    except BaseException:
        stop_requested.set()
        raise
    stop_requested.clear()


def _kill_engine_and_exit(why: str, signum: int) -> None:
    """Kill every process this one started (Ray's GCS, raylet, workers) and exit at once."""
    logger.error("run stopped: %s; killing the simulation engine", why)
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(128 + signum)


def absolute_paths(experiment: ExperimentConfig) -> ExperimentConfig:
    """Make out-dir, ledger-dir, data-dir and initial-weights absolute (Ray workers have
    other cwds)."""
    update = {}
    for key in ("out_dir", "ledger_dir", "data_dir", "initial_weights"):
        value = getattr(experiment, key)
        if value:
            update[key] = str(Path(value).expanduser().resolve())
    return parse_run_config({**experiment.to_run_config(),
                             **{k.replace("_", "-"): v for k, v in update.items()}})


__all__ = ["absolute_paths", "experiment_to_run", "resumed_experiment", "run_simulation"]
