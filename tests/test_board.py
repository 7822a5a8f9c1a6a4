"""Per-round metrics in TensorBoard event files (dpcfl_flwr/results/board.py), read back with
TensorBoard's own reader: a real simulation's scalars equal what its results.json reports; a
resumed run's rewritten rounds show once; ``tensorboard = false`` writes none; ``dpcfl
report`` reads results directories with and without the event files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.protocol import ModelLayout
from dpcfl_flwr.results.board import BOARD_DIR, BoardWriter, event_files
from dpcfl_flwr.runs.simulation import run_simulation
from dpcfl_flwr.server_app import initial_arrays, run_experiment

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

ROUNDS = 4
SMALL = {  # the quick example, shrunk: R-DPCFL, a minority cluster, two evaluations
    "clusters": "2,3,3", "rdpcfl.n-clusters": 3, "rdpcfl.select-window": 0.25,
    "samples-per-client": 200, "test-samples": 200, "num-server-rounds": ROUNDS,
    "eval-every": 2,
}


def scalars(results_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's event files, by tag and step, as TensorBoard loads them."""
    board = EventAccumulator(str(results_dir / BOARD_DIR))
    board.Reload()
    return {tag: {event.step: event.value for event in board.Scalars(tag)}
            for tag in board.Tags()["scalars"]}


def report(results_dir: Path) -> str:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "report", str(results_dir),
                           "--no-plots"], capture_output=True, text=True, timeout=300,
                          env=env, check=True).stdout


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("board") / "run"
    run_simulation(parse_run_config({**SMALL, "out-dir": str(out)}))
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_event_files_of_a_simulation_hold_what_results_json_reports(simulated):
    out, results = simulated
    assert results["complete"] and len(event_files(out)) == 1
    board = scalars(out)
    by_round = {
        "accuracy/test-mean": "mean_test_accuracy",
        "accuracy/test-minority": "minority_test_accuracy",
        "accuracy/validation-mean": "mean_val_accuracy",
        "privacy/max-epsilon-spent": "max_epsilon_spent",
        "round/trained-silos": "trained",
        "round/seconds": "seconds",
        "round/server-seconds": "server_seconds",
    }
    for tag, column in by_round.items():
        expected = {r["round"]: r[column] for r in results["rounds"] if r[column] is not None}
        assert sorted(board[tag]) == sorted(expected), tag  # a step for each known value
        for step, value in expected.items():  # results.json rounds seconds to 3 places
            assert board[tag][step] == pytest.approx(value, rel=1e-6, abs=6e-4), (tag, step)
    assert sorted(board["accuracy/test-mean"]) == [2, 4]  # the evaluation rounds only
    for row in results["rounds"]:
        sizes = [board[f"clusters/{m}/silos"][row["round"]] for m in
                 range(len(row["cluster_sizes"]))]
        assert sizes == row["cluster_sizes"]
        for partition, accuracy in row["test_accuracy"].items():
            assert board[f"silo/{partition}/test-accuracy"][row["round"]] == pytest.approx(
                accuracy, rel=1e-6)
    for client in results["clients"]:
        spent = board[f"silo/{client['partition']}/epsilon-spent"]
        assert sorted(spent) == list(range(1, ROUNDS + 1))
        assert spent[ROUNDS] == pytest.approx(client["epsilon_spent"], rel=1e-6)
        assert np.all(np.diff([spent[r] for r in sorted(spent)]) >= 0)  # spend only grows


@pytest.mark.slow
def test_report_names_the_event_files(simulated):
    out, _ = simulated
    assert f"tensorboard --logdir {out / BOARD_DIR}" in report(out)


def test_a_resumed_run_replaces_the_rounds_it_runs_again(tmp_path):
    """The killed run wrote rounds 1-4, its checkpoint holds 2: the resumed run writes 3-5,
    and TensorBoard shows every round once, 3 and 4 with the resumed run's values."""
    killed = BoardWriter(tmp_path)
    for step in range(1, 5):
        killed.write(step, {"accuracy/test-mean": step / 10})
    killed.close()
    resumed = BoardWriter(tmp_path, after_round=2)
    for step in range(3, 6):
        resumed.write(step, {"accuracy/test-mean": step / 10 + 0.5})
    resumed.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    board = EventAccumulator(str(tmp_path))
    board.Reload()
    shown = [(e.step, round(e.value, 4)) for e in board.Scalars("accuracy/test-mean")]
    assert shown == [(1, 0.1), (2, 0.2), (3, 0.8), (4, 0.9), (5, 1.0)]


@pytest.mark.parametrize("on", [True, False])
def test_the_tensorboard_key_turns_the_event_files_on_and_off(server_task_identity, tmp_path,
                                                               on):
    """A scripted run through run_experiment, as the ServerApp runs it."""
    experiment = parse_run_config({"method": "global", "clusters": "2,3,3",
                                   "num-server-rounds": 2, "eval-every": 2,
                                   "wait-for-clients": 5.0, "round-timeout": 10.0,
                                   "tensorboard": on, "out-dir": str(tmp_path)})
    layout = ModelLayout.of(initial_arrays(experiment))
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    run_experiment(GridDouble({NODE + p: ScriptedSilo(p, layout, centres)
                               for p in range(len(TRUTH))}), experiment)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"]
    if on:
        board = scalars(tmp_path)
        assert board["accuracy/test-mean"] == {
            2: pytest.approx(results["rounds"][-1]["mean_test_accuracy"])}
        assert sorted(board["privacy/max-epsilon-spent"]) == [1, 2]
    else:
        assert not (tmp_path / BOARD_DIR).exists() and not event_files(tmp_path)
        # a results directory without event files, as runs before them left: report reads it
        assert "--logdir" not in report(tmp_path)
