"""A table MLP trained end to end: three deployed silos, each with its own arrays file of six
features, run the real ServerApp's experiment against their real ClientApps (the in-memory grid
stands in for the SuperLink only: Flower's simulation engine gives silos no node config of
their own, so it cannot name their files). The federation chooses ``model = "mlp"``; the
accuracy climbs far above chance and each silo logs once that the MLP trains on the layerwise
engine."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.models import MLP
from dpcfl_flwr.server_app import run_experiment
from dpcfl_flwr.silo.kept_model import load_silo_model
from tests.grid_double import GridDouble

SILOS, FEATURES, CLASSES, RECORDS = 3, 6, 3, 300


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _records(path: Path, seed: int, rule: np.ndarray) -> Path:
    """A silo's own table: standard normal features, the label the shared linear rule gives."""
    x = np.random.default_rng(seed).normal(size=(RECORDS, FEATURES)).astype(np.float32)
    np.savez(path, x=x, y=np.argmax(x @ rule, axis=1).astype(np.int64))
    return path


def _silo(tmp_path: Path, partition: int, run_config: dict, rule: np.ndarray) -> Context:
    schema = tmp_path / "schema.toml"  # the federation's, pinned by every silo
    schema.write_text(f'input-shape = "{FEATURES}"\nnum-classes = {CLASSES}\n')
    node = {"partition-id": partition, "epsilon": 8.0, "delta": 1e-4, "schema-file": str(schema),
            "ledger-path": str(tmp_path / f"silo-{partition}" / "ledger.json"),
            "data-source": "arrays", "data-seed": partition, "metrics": "exact",
            "data-path": str(_records(tmp_path / f"silo-{partition}.npz", partition, rule))}
    return Context(run_id=1, node_id=700 + partition, node_config=node, state=RecordDict(),
                   run_config=run_config)


@pytest.mark.slow
def test_an_mlp_trains_on_the_silos_own_tables(tmp_path, server_task_identity, caplog):
    experiment = parse_run_config({
        "method": "global", "clusters": str(SILOS), "model": "mlp", "input-shape": "6",
        "num-classes": CLASSES, "model-params.hidden": "16", "num-server-rounds": 8,
        "eval-every": 4, "batch-size": 50, "learning-rate": 0.5, "clip-norm": 1.0,
        "out-dir": str(tmp_path / "run"), "tensorboard": False, "wait-for-clients": 5.0})
    rule = np.random.default_rng(42).normal(size=(FEATURES, CLASSES))
    contexts = {700 + p: _silo(tmp_path, p, experiment.to_run_config(), rule)
                for p in range(SILOS)}
    grid = GridDouble({node: (lambda message, c=context: client_app(message, c))
                       for node, context in contexts.items()})
    with caplog.at_level(logging.INFO):
        results = run_experiment(grid, experiment)
    assert results["complete"]
    by_silo = {c["partition"]: c["test_accuracy"] for c in results["clients"]}
    accuracies = list(by_silo.values())
    # chance is 1/3; the DP noise is the silos' own (OS entropy), so the bound leaves room
    assert len(accuracies) == SILOS and min(accuracies) > 0.55, accuracies
    assert np.mean(accuracies) > 0.65, accuracies
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["summary"]["mean_accuracy"] == pytest.approx(np.mean(accuracies))
    # each silo's kept final model reads back as the run's MLP (its parameters in the file)
    kept, metadata = load_silo_model(next((tmp_path / "silo-0").glob("*.model.pt")))
    assert isinstance(kept, MLP) and metadata["model_params"] == {"hidden": "16"}
    assert metadata["test_accuracy"] == pytest.approx(by_silo[0])
    for p in range(SILOS):  # once per silo and run, not once per round
        line = f"silo {p}: model mlp trains with the layerwise engine"
        assert caplog.text.count(line) == 1, caplog.text[-2000:]


def test_simulate_stops_with_one_line_when_the_model_cannot_be_built(tmp_path):
    """``dpcfl simulate`` builds the model before Ray starts: a prefix that matches nothing, a
    weights file that is not the model's, is its one error line (exit 2)."""
    torch.save({"w": torch.zeros(1)}, tmp_path / "w.pt")
    for overrides, expected in (
            (["model=mlp", "input-shape=6", "trainable=clasifier"],
             "'clasifier' matches no parameter of model 'mlp'"),
            (["model=mlp", "input-shape=6", f"initial-weights={tmp_path / 'w.pt'}"],
             "its tensors are not the model's")):
        sets = [part for item in overrides for part in ("--set", item)]
        bad = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "simulate", *sets,
                              "--out", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], bad.stderr
        assert not (tmp_path / "x").exists()  # nothing started


@pytest.mark.slow
def test_a_simulation_trains_the_mlp_on_arrays_records(tmp_path):
    """The same federation in Flower's simulation engine (Ray): the run config names each
    silo's arrays file (silo-data-paths, simulation only) and the MLP; the run completes and
    every silo ends well above chance."""
    from dpcfl_flwr.runs.simulation import run_simulation

    rule = np.random.default_rng(42).normal(size=(FEATURES, CLASSES))
    for p in range(SILOS):
        _records(tmp_path / f"silo-{p}.npz", p, rule)
    out = tmp_path / "run"
    experiment = parse_run_config({
        "method": "global", "clusters": str(SILOS), "data-source": "arrays",
        "silo-data-paths": str(tmp_path / "silo-{partition}.npz"), "model": "mlp",
        "input-shape": "6", "num-classes": CLASSES, "model-params.hidden": "16",
        "num-server-rounds": 8, "eval-every": 4, "batch-size": 50, "learning-rate": 0.5,
        "clip-norm": 1.0, "epsilon": 8.0, "out-dir": str(out), "tensorboard": False})
    run_simulation(experiment, cpus=2)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True
    accuracies = [c["test_accuracy"] for c in results["clients"]]
    assert len(accuracies) == SILOS and min(accuracies) > 0.55, accuracies  # chance: 1/3
    assert np.mean(accuracies) > 0.65, accuracies
