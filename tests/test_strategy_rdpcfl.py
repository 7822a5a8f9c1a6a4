"""R-DPCFL's stages driven message by message with scripted silo replies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Message

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.methods.base import INITIAL
from dpcfl_flwr.protocol import ARRAYS, SELECT, ModelLayout, cluster_key, model_records
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import ClusteredStrategy

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo


@pytest.fixture()
def run(server_task_identity):
    experiment = parse_run_config({
        "clusters": "2,3,3", "rdpcfl.n-clusters": 3, "num-server-rounds": 10,
        "rdpcfl.select-window": 0.2,
        "eval-every": 3, "out-dir": "unused"})
    initial = initial_arrays(experiment)
    strategy = ClusteredStrategy(experiment, initial)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    grid = GridDouble({NODE + p: ScriptedSilo(p, layout, centres) for p in range(len(TRUTH))})
    strategy.discover(grid, expected=len(TRUTH), wait=1)
    strategy.start(grid, initial, experiment.num_server_rounds, timeout=10)
    return strategy, grid, layout


def _train_messages(grid: GridDouble, server_round: int) -> dict[int, Message]:
    return {m.metadata.dst_node_id - NODE: m for m in grid.of_type("train")
            if int(m.content.config_records["config"]["server-round"]) == server_round}


def test_round_one_sends_theta_init_with_full_batch_and_clusters_exactly(run):
    strategy, grid, layout = run
    first = _train_messages(grid, 1)
    assert sorted(first) == list(range(len(TRUTH)))
    for message in first.values():
        config = message.content.config_records["config"]
        assert (config["stage"], config["round-batch"], config["cluster"]) == (
            "clustering", "full", INITIAL)
        np.testing.assert_array_equal(layout.flatten(model_records(message.content)[ARRAYS]),
                                      strategy.initial)
    outcome = strategy.method.clustering
    labels = dict(zip(outcome.partitions, outcome.labels, strict=True))
    # Same true cluster <=> same GMM label: the exact partition.
    for a in range(len(TRUTH)):
        for b in range(len(TRUTH)):
            assert (labels[a] == labels[b]) == (TRUTH[a] == TRUTH[b])
    assert outcome.mss > 3
    assert strategy.method.switch == math.floor((1 - outcome.mpo) * 10 / 2) == 5


def test_soft_stage_sends_each_silo_the_model_of_its_gmm_cluster(run):
    strategy, grid, layout = run
    outcome = strategy.method.clustering
    labels = dict(zip(outcome.partitions, outcome.labels, strict=True))
    for server_round in range(2, 6):
        for partition, message in _train_messages(grid, server_round).items():
            config = message.content.config_records["config"]
            assert config["stage"] == "soft"
            assert config["round-batch"] == "32"
            # pi is one-hot for separated clusters, so the draw is the GMM label.
            assert int(config["cluster"]) == labels[partition]
    # Round 2's models were all theta_init (reset after round 1, Alg. 1 line 13).
    for message in _train_messages(grid, 2).values():
        np.testing.assert_array_equal(
            layout.flatten(model_records(message.content)[ARRAYS]), strategy.initial)


def test_select_window_sends_all_models_and_then_freezes_the_choice(run):
    strategy, grid, layout = run
    select_rounds = [r for r in range(1, 11)
                     if _train_messages(grid, r)[0].content.config_records["config"]["stage"]
                     == "select"]
    assert select_rounds == [6, 7]  # E_c + 1 .. E_c + T_sel, T_sel = int(0.2 * 10)
    for server_round in select_rounds:
        for message in _train_messages(grid, server_round).values():
            records = model_records(message.content)
            assert int(message.content.config_records["config"]["cluster"]) == SELECT
            assert sorted(records) == [cluster_key(m) for m in range(3)]
            assert list(message.content) == ["config"]  # three models, still one record
    for server_round in (8, 9, 10):
        for partition, message in _train_messages(grid, server_round).items():
            config = message.content.config_records["config"]
            assert config["stage"] == "frozen"
            assert int(config["cluster"]) == strategy.method.choice[partition]
    # Every silo picked the model its own kind trained: the choices are the true partition.
    for a in range(len(TRUTH)):
        for b in range(len(TRUTH)):
            choice = strategy.method.choice
            assert (choice[a] == choice[b]) == (TRUTH[a] == TRUTH[b])


def test_cluster_models_are_uniform_means_of_their_members_updates(run):
    strategy, grid, layout = run
    outcome = strategy.method.clustering
    labels = dict(zip(outcome.partitions, outcome.labels, strict=True))
    # Each member of a cluster pushes +1 on its own coordinate every round from round 2 on;
    # uniform averaging gives +1 per round on that coordinate, for 9 rounds.
    for partition, label in labels.items():
        np.testing.assert_allclose(
            strategy.models[label][TRUTH[partition]] - strategy.initial[TRUTH[partition]], 9.0,
            rtol=1e-5)


def test_evaluation_uses_the_model_each_silo_would_use(run):
    strategy, grid, _ = run
    evaluations = grid.of_type("evaluate")
    assert {int(m.content.config_records["config"]["server-round"]) for m in evaluations} == {
        3, 6, 9, 10}
    assert all(s.test_accuracy == 1.0 for s in strategy.silos.values())


_BUILD_THE_STRATEGY = """
import sys
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import ClusteredStrategy
experiment = parse_run_config({"clusters": "2,2", "out-dir": "unused"})
before = "sklearn.mixture" in sys.modules
ClusteredStrategy(experiment, initial_arrays(experiment))
print(before, "sklearn.mixture" in sys.modules, "sklearn.cluster" in sys.modules)
"""


def test_the_server_loads_the_mixture_code_when_it_starts_not_in_round_ones_clustering():
    """scikit-learn's mixture code (0.07-0.1 s to import) is loaded as the strategy is built,
    while the silos train round 1, so round 1's clustering does not wait for it."""
    import subprocess
    import sys
    from pathlib import Path

    loaded = subprocess.run([sys.executable, "-c", _BUILD_THE_STRATEGY], check=True,
                            capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert loaded == ["False", "True", "True"]
