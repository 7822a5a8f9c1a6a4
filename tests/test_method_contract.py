"""The method contract: every registered method, driven hook by hook through Flower's API.

Like scikit-learn's ``check_estimator``: :func:`check_method` runs one method through
``configure_train`` -> silos -> ``aggregate_train`` and the evaluate pair, round by round, and
checks what any method must guarantee: every message is one a silo accepts (validated as the
silo validates it), clusters are in range, replies fold into finite models of the right size,
its parameters round-trip through the flat run config. The toy method at the end is defined
in this file only: adding a method touches one file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from pydantic import Field

from dpcfl_flwr.config import registry
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.methods.base import INITIAL, Method, MethodParams, ServerState, TrainReply
from dpcfl_flwr.protocol import MAJORITY, OWN, SELECT, ModelLayout
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo.requests import EvaluateRequest, TrainRequest, parse_request
from dpcfl_flwr.strategies import ClusteredStrategy

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

ROUNDS = 5
DOCS = Path(__file__).parents[1] / "docs"


def _strategy(method: str) -> tuple[ClusteredStrategy, GridDouble, ModelLayout]:
    """``method`` on the {2, 3, 3} scripted silos, M = 3 for the methods that take M."""
    tables = {f"{name}.n-clusters": 3 for name, cls in registry.methods().items()
              if "n_clusters" in cls.Params.model_fields}
    experiment = parse_run_config({"method": method, "clusters": "2,3,3", **tables,
                                   "num-server-rounds": ROUNDS, "eval-every": 2,
                                   "out-dir": "unused"})
    initial = initial_arrays(experiment)
    strategy = ClusteredStrategy(experiment, initial)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    grid = GridDouble({NODE + p: ScriptedSilo(p, layout, centres) for p in range(len(TRUTH))})
    strategy.discover(grid, expected=len(TRUTH), wait=1)
    return strategy, grid, layout


def check_method(name: str) -> None:
    """Drive method ``name`` through every round with Flower's four hooks, checking each."""
    strategy, grid, layout = _strategy(name)
    nodes = {s.node_id: p for p, s in strategy.silos.items()}
    for server_round in range(1, ROUNDS + 1):
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(),
                                                 grid))
        trained = sorted(nodes[m.metadata.dst_node_id] for m in messages)
        # every silo in round 1; later, each silo once at most (a method may leave some out)
        assert trained == sorted(nodes.values()) if server_round == 1 else (
            len(set(trained)) == len(trained) and set(trained) <= set(nodes.values()))
        for message in messages:
            assert message.metadata.message_type == "train" and message.metadata.ttl > 0
            request = parse_request(TrainRequest, message)  # what the silo would accept
            assert request.server_round == server_round
            assert request.cluster in (INITIAL, OWN, SELECT, MAJORITY) or (
                0 <= request.cluster < strategy.n_clusters)
            assert bool(request.personal) == strategy.method.personal
        replies = list(grid.send_and_receive(messages))
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert arrays is None  # the cluster models stay on the strategy
        assert metrics is not None and metrics["silos-trained"] == len(replies)
        report = strategy.reports[-1]
        assert report.round == server_round and not report.dropped
        for model in strategy.models:
            assert model.shape == (layout.size,) and model.dtype == np.float32
            assert np.isfinite(model).all()
        evaluations = list(strategy.configure_evaluate(server_round, ArrayRecord(),
                                                       ConfigRecord(), grid))
        assert len(evaluations) == (len(nodes) if strategy.evaluates(server_round) else 0)
        for message in evaluations:
            request = parse_request(EvaluateRequest, message)
            current = strategy.current_cluster(nodes[message.metadata.dst_node_id])
            assert request.cluster == current
            assert current in (OWN, MAJORITY) or 0 <= current < strategy.n_clusters
        evaluated = strategy.aggregate_evaluate(server_round, grid.send_and_receive(evaluations))
        assert (evaluated is not None) == strategy.evaluates(server_round)
    assert set(strategy.cluster_arrays().keys()) == {
        f"cluster-{m}.{key}" for m in range(strategy.n_clusters) for key in layout.names}
    _check_parameters(name)


def _check_parameters(name: str) -> None:
    """The method's table has defaults, kebab-case keys, and survives the flat run config."""
    cls = registry.method_class(name)
    assert cls.name == name and cls.title
    defaults = cls.Params()
    experiment = parse_run_config({"method": name})
    assert experiment.params == defaults
    assert parse_run_config(experiment.to_run_config()) == experiment
    for key in defaults.model_dump(by_alias=True):
        assert f"{name}.{key}" in experiment.to_run_config()
        assert key == key.lower() and "_" not in key


@pytest.mark.parametrize("name", registry.method_names())
def test_every_registered_method_keeps_the_contract(server_task_identity, name):
    check_method(name)


@pytest.mark.parametrize("name", registry.method_names())
def test_every_registered_method_is_documented(name):
    """The method reference (docs/algorithm.md) has a word on each method it can run."""
    assert f"`{name}`" in (DOCS / "algorithm.md").read_text()


# --- a method added in one file ----------------------------------------------------------------
class RoundRobinParams(MethodParams):
    n_clusters: int = Field(2, ge=1)


class RoundRobin(Method):
    """Silo p trains cluster (p + round) mod M; it keeps cluster p mod M."""

    name = "round-robin-toy"
    title = "a toy: clusters in turn"
    Params = RoundRobinParams

    def __init__(self, experiment: Any, params: Any, state: ServerState) -> None:
        super().__init__(experiment, params, state)
        self.seen: list[dict[int, TrainReply]] = []

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return {p: (p + server_round) % self.n_clusters for p in partitions}

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        self.seen.append(replies)
        super().absorb(server_round, replies)

    def current_cluster(self, partition: int) -> int:
        return partition % self.n_clusters


@pytest.fixture()
def toy_method():
    registry.register(RoundRobin)
    yield RoundRobin.name
    registry.unregister(RoundRobin.name)


def test_a_method_defined_in_one_file_runs_through_flowers_loop(server_task_identity,
                                                                toy_method):
    check_method(toy_method)
    strategy, grid, _ = _strategy(toy_method)  # M = 3 from its table, like every method's
    experiment, m = strategy.experiment, 3
    assert experiment.params == RoundRobinParams(n_clusters=m)
    result = strategy.start(grid, initial_arrays(experiment), ROUNDS, timeout=10)
    method = strategy.method
    assert isinstance(method, RoundRobin) and len(method.seen) == ROUNDS
    for server_round, replies in enumerate(method.seen, start=1):
        assert {p: r.cluster for p, r in replies.items()} == {
            p: (p + server_round) % m for p in range(len(TRUTH))}
    # Flower's history has every round; the Result carries every cluster model.
    assert sorted(result.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert sorted(result.evaluate_metrics_clientapp) == [2, 4, 5]
    assert {key.split(".")[0] for key in result.arrays} == {f"cluster-{c}" for c in range(m)}
    # Each scripted silo's update is +1 on coordinate TRUTH[p]; a cluster model moves by the
    # uniform mean of its trainers' updates each round.
    expected = np.zeros((m, 3))
    for server_round in range(1, ROUNDS + 1):
        for c in range(m):
            members = [p for p in range(len(TRUTH)) if (p + server_round) % m == c]
            for p in members:
                expected[c, TRUTH[p]] += 1 / len(members)
    for c in range(m):
        np.testing.assert_allclose(strategy.models[c][:3] - strategy.initial[:3], expected[c],
                                   rtol=1e-5)
    assert registry.method_class(toy_method) is RoundRobin


def test_a_second_method_cannot_take_a_registered_name():
    clash = type("Clash", (RoundRobin,), {"name": "rdpcfl"})
    with pytest.raises(ValueError, match="'rdpcfl' is taken"):
        registry.register(clash)
