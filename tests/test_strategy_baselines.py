"""The baselines' message flows with scripted silos: who gets which model, what is charged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from dpcfl_flwr.config.settings import ConfigError, parse_run_config
from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp
from dpcfl_flwr.flower_compat.ended_sessions import SESSION_ENDED, error_reply
from dpcfl_flwr.methods.base import INITIAL, TrainReply
from dpcfl_flwr.models import build_model
from dpcfl_flwr.protocol import (
    ANCHOR,
    ARRAYS,
    METRICS,
    OWN,
    SELECT,
    SILO,
    UPDATE,
    ModelLayout,
    cluster_key,
    metrics_of,
    model_records,
    one_record,
    pack,
)
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import build_strategy
from dpcfl_flwr.strategies.replies import far_off_updates

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

ROUNDS = 6


def _run(method: str, make_silo=ScriptedSilo, **extra):
    experiment = parse_run_config({
        "method": method, "clusters": "2,3,3", "num-server-rounds": ROUNDS,
        **{f"{m}.n-clusters": 3 for m in ("rdpcfl", "ifca", "km")},
        **{f"{m}.select-window": 0.34 for m in ("rdpcfl", "ifca")},
        "eval-every": 3, "out-dir": "unused", **extra})
    initial = initial_arrays(experiment)
    strategy = build_strategy(experiment, initial)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    silos = {NODE + p: make_silo(p, layout, centres) for p in range(len(TRUTH))}
    grid = GridDouble(silos)
    strategy.discover(grid, expected=len(TRUTH), wait=1)
    strategy.start(grid, initial, ROUNDS, timeout=10)
    return strategy, grid, layout


def _configs(grid: GridDouble, server_round: int) -> dict[int, dict]:
    return {m.metadata.dst_node_id - NODE: dict(m.content.config_records["config"])
            for m in grid.of_type("train")
            if int(m.content.config_records["config"]["server-round"]) == server_round}


def _messages(grid: GridDouble, server_round: int):
    return {m.metadata.dst_node_id - NODE: m for m in grid.of_type("train")
            if int(m.content.config_records["config"]["server-round"]) == server_round}


@pytest.mark.parametrize("method", ["global", "local", "mrmtl", "oracle", "km"])
def test_single_stage_baselines_charge_no_selection_and_the_same_batch_every_round(
        server_task_identity, method):
    _, grid, _ = _run(method)
    for server_round in range(1, ROUNDS + 1):
        for config in _configs(grid, server_round).values():
            # The schedule every silo calibrates z for: b in all E rounds, no selections.
            assert (config["first-batch"], config["batch-size"], config["round-batch"]) == (
                "32", 32, "32")
            assert config["select-rounds"] == 0 and config["rounds"] == ROUNDS
            assert int(config["cluster"]) != SELECT


def test_global_sends_everyone_the_one_model(server_task_identity):
    strategy, grid, layout = _run("global")
    for server_round in range(1, ROUNDS + 1):
        messages = _messages(grid, server_round)
        vectors = [layout.flatten(model_records(m.content)[ARRAYS]) for m in messages.values()]
        assert all(np.array_equal(v, vectors[0]) for v in vectors)
    # Every silo pushes +1 on its own true-cluster coordinate: the mean over 8 silos.
    expected = np.bincount(TRUTH, minlength=3) / len(TRUTH) * ROUNDS
    np.testing.assert_allclose(strategy.models[0][:3] - strategy.initial[:3], expected,
                               rtol=1e-5)


def test_oracle_trains_each_true_cluster_separately(server_task_identity):
    strategy, grid, _ = _run("oracle")
    for server_round in range(1, ROUNDS + 1):
        for partition, config in _configs(grid, server_round).items():
            assert int(config["cluster"]) == TRUTH[partition]
    for cluster in range(3):
        np.testing.assert_allclose(
            strategy.models[cluster][cluster] - strategy.initial[cluster], ROUNDS, rtol=1e-5)


def test_local_sends_theta_init_once_then_nothing_and_gets_no_updates(server_task_identity):
    strategy, grid, _ = _run("local")
    first = _messages(grid, 1)
    assert all(ARRAYS in model_records(m.content) for m in first.values())
    assert all(int(m.content.config_records["config"]["cluster"]) == INITIAL
               for m in first.values())
    for server_round in range(2, ROUNDS + 1):
        for message in _messages(grid, server_round).values():
            assert not model_records(message.content)  # no weights leave the server
            assert int(message.content.config_records["config"]["cluster"]) == OWN
            assert int(message.content.config_records["config"]["personal"]) == 1
    assert strategy.models == []  # the server never holds the silos' models
    assert all(not model_records(m.content) for m in grid.of_type("evaluate"))


def test_mrmtl_sends_each_silo_its_model_and_the_mean_anchor(server_task_identity):
    strategy, grid, layout = _run("mrmtl")
    for server_round in range(1, ROUNDS + 1):
        messages = _messages(grid, server_round)
        anchors = [layout.flatten(model_records(m.content)[ANCHOR]) for m in messages.values()]
        assert all(np.array_equal(a, anchors[0]) for a in anchors)
        for partition, message in messages.items():
            assert int(message.content.config_records["config"]["cluster"]) == partition
            assert message.content.config_records["config"]["prox-lambda"] == 1.0
    # Silo p's model moved +1 per round on its coordinate; the anchor is their mean.
    np.testing.assert_allclose(strategy.method.anchor()[:3] - strategy.initial[:3],
                               np.bincount(TRUTH, minlength=3) / len(TRUTH) * ROUNDS, rtol=1e-5)


def test_ifca_draws_round_one_then_selects_for_t_sel_rounds_and_freezes(server_task_identity):
    strategy, grid, _ = _run("ifca")
    t_sel = int(0.34 * ROUNDS)
    first = _configs(grid, 1)
    assert {int(c["cluster"]) for c in first.values()} <= {0, 1, 2}
    stages = [next(iter(_configs(grid, r).values()))["stage"] for r in range(1, ROUNDS + 1)]
    assert stages == ["random"] + ["select"] * t_sel + ["frozen"] * (ROUNDS - 1 - t_sel)
    for server_round in range(2, 2 + t_sel):
        for message in _messages(grid, server_round).values():
            assert sorted(model_records(message.content)) == [cluster_key(m) for m in range(3)]
            config = message.content.config_records["config"]
            # IFCA charges T_sel selections and calibrates single-stage noise
            # (docs/algorithm.md#dp-ifca).
            assert (config["select-rounds"], config["first-batch"]) == (t_sel, "32")
    for server_round in range(2 + t_sel, ROUNDS + 1):
        for partition, config in _configs(grid, server_round).items():
            assert int(config["cluster"]) == strategy.method.choice[partition]


def test_km_regroups_silos_by_k_means_on_their_updates(server_task_identity):
    strategy, grid, _ = _run("km")
    assert all(int(c["cluster"]) == INITIAL for c in _configs(grid, 1).values())
    labels = strategy.method.labels
    for a in range(len(TRUTH)):
        for b in range(len(TRUTH)):
            assert (labels[a] == labels[b]) == (TRUTH[a] == TRUTH[b])
    for server_round in range(2, ROUNDS + 1):  # each round trains the last round's groups
        sent = {p: int(c["cluster"]) for p, c in _configs(grid, server_round).items()}
        for a in range(len(TRUTH)):
            for b in range(len(TRUTH)):
                assert (sent[a] == sent[b]) == (TRUTH[a] == TRUTH[b])


def test_ifca_and_km_need_the_number_of_clusters():
    for method in ("ifca", "km"):
        with pytest.raises(ConfigError,
                           match=f"'{method}.n-clusters' = 0 is invalid: .* equal to 2"):
            parse_run_config({"method": method, f"{method}.n-clusters": 0, "out-dir": "x"})


# --- MR-MTL's regulariser ------------------------------------------------------------------------
def test_mrmtl_proximal_term_changes_the_update_by_exactly_lambda_times_the_gap():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 1, 28, 28, generator=g), torch.randint(0, 10, (20,), generator=g)
    start = build_model("cnn", seed=3).state_dict()
    anchor = {k: v + 0.5 for k, v in start.items()}
    config = DPSGDConfig(1.0, 1.0, 0.1, "full")

    def update(prox):
        model = build_model("cnn")
        model.load_state_dict(start)
        return train_dp(model, x, y, config, seed=9, prox=prox).update

    plain, regularised = update(None), update((2.0, anchor))
    # One step: the difference is -lr * lambda * (theta - anchor) = -0.1 * 2 * (-0.5) = +0.1.
    for key in plain:
        torch.testing.assert_close(regularised[key] - plain[key],
                                   torch.full_like(plain[key], 0.1), rtol=1e-4, atol=1e-5)


class SiloSendingBadReplies(ScriptedSilo):
    """Silo 0 replies to rounds 3, 4 and 5 with a NaN update, a cluster the run does not
    have, and no epsilon; every other reply is the scripted one."""

    def _train(self, message, cluster):
        reply = super()._train(message, cluster)
        server_round = int(message.content.config_records["config"]["server-round"])
        if self.partition != 0 or server_round not in (3, 4, 5):
            return reply
        metrics = dict(metrics_of(reply))
        update = self.layout.flatten(metrics.pop(UPDATE))
        if server_round == 3:
            update[5] = np.nan
        elif server_round == 4:
            metrics["cluster"] = 7
        else:
            del metrics["epsilon-spent"]
        return self._reply(message, one_record(METRICS, metrics, {UPDATE: pack(update)}))


def test_a_reply_the_server_cannot_use_costs_that_silo_its_round_not_the_run(
        server_task_identity, caplog):
    strategy, grid, _ = _run("oracle", make_silo=SiloSendingBadReplies)
    assert strategy.silos[0].dropped_rounds == [3, 4, 5]
    assert all(s.dropped_rounds == [] for p, s in strategy.silos.items() if p != 0)
    assert all(np.isfinite(model).all() for model in strategy.models)
    assert len(grid.of_type("train")) == ROUNDS * len(TRUTH)  # silo 0 was asked every round
    complaints = [r.getMessage() for r in caplog.records if "cannot use" in r.getMessage()]
    assert [c.split(":")[0] for c in complaints] == ["round 3", "round 4", "round 5"]
    assert "non-finite" in complaints[0] and "cluster 7" in complaints[1]
    assert "epsilon-spent" in complaints[2]


class SiloDescribingItselfBadly(ScriptedSilo):
    """Silo 2 answers the query without its train-set size; everything else is scripted."""

    def __call__(self, message):
        reply = super().__call__(message)
        if self.partition != 2 or message.metadata.message_type != "query":
            return reply
        described = dict(reply.content.metric_records[SILO])
        del described["num-train"]
        return self._reply(message, RecordDict({SILO: MetricRecord(described)}))


def test_a_silo_the_server_cannot_register_is_left_out_not_the_run(server_task_identity,
                                                                     caplog):
    strategy, grid, _ = _run("oracle", make_silo=SiloDescribingItselfBadly)
    assert sorted(strategy.silos) == [p for p in range(len(TRUTH)) if p != 2]
    assert all(m.metadata.dst_node_id != NODE + 2 for m in grid.of_type("train"))
    assert len(grid.of_type("train")) == ROUNDS * (len(TRUTH) - 1)
    complaints = [r.getMessage() for r in caplog.records if "cannot use" in r.getMessage()]
    assert complaints and all(f"node {NODE + 2}" in c and "num-train" in c for c in complaints)


class SiloLostBySuperLink(ScriptedSilo):
    """Silo 1's round-2 training and round-3 evaluation are answered by the SuperLink in its
    name (its session ended with the message in hand): the error reply Flower's SuperLink
    sends, from the SuperLink's own node, not the silo's."""

    def __call__(self, message):
        config = message.content.config_records.get("config", {})
        lost = (message.metadata.message_type, int(config.get("server-round", 0)))
        if self.partition == 1 and lost in (("train", 2), ("evaluate", 3)):
            return error_reply(message)
        return super().__call__(message)


def test_an_error_the_superlink_sends_in_a_silos_name_counts_for_that_silo(
        server_task_identity, caplog):
    strategy, grid, _ = _run("oracle", make_silo=SiloLostBySuperLink)
    assert strategy.silos[1].dropped_rounds == [2]
    assert all(s.dropped_rounds == [] for p, s in strategy.silos.items() if p != 1)
    said = [r.getMessage() for r in caplog.records if "silo 1" in r.getMessage()]
    assert f"round 2: silo 1 failed (code 5): {SESSION_ENDED}" in said
    assert f"evaluation on silo 1 failed: {SESSION_ENDED}" in said
    assert not any("did not reply" in r.getMessage() for r in caplog.records)
    first_eval = strategy.reports[2].test_accuracy
    assert 1 not in first_eval and len(first_eval) == len(TRUTH) - 1


def test_an_update_is_far_off_only_beside_a_median_of_three_or_more():
    """far_off_updates: norms against the median of the round's updates (silos that keep their
    model send none), from 3 updates on; a norm past float32's range is infinitely far."""
    def replies(*norms):
        return {i: TrainReply(0, None if n is None else np.full(4, n / 2, np.float32), {})
                for i, n in enumerate(norms)}

    assert far_off_updates(replies(1.0, 2.0, 2001.0, 1.5)) == {2: pytest.approx(2001 / 1.75)}
    assert far_off_updates(replies(1.0, 1.0, 999.0)) == {}  # 999x the median of 1: kept
    assert far_off_updates(replies(1.0, 1e9)) == {}  # two updates: no median for the others
    assert far_off_updates(replies(1.0, None, None, 1e9)) == {}
    assert far_off_updates(replies(0.0, 0.0, 5.0)) == {}  # a median of 0 judges nothing
    assert far_off_updates(replies(1.0, 1.0, 3e38)) == {2: math.inf}
    assert far_off_updates(replies(1.0, 2.0, 30.0), ratio=10) == {2: 15.0}
