"""The server as an attacker: it writes any run config and any message, and the real ClientApp
handlers (no mocked privacy code) must never release more than the silo's own (epsilon, delta).

Every test ends with the same two checks (:meth:`Attacker.assert_within_budget`): the ledger on
the silo's disk composes to at most its budget, and every update that left the silo was charged
before it left. The silo is a deployed one: its node config holds its budget, ledger and split.
"""

from __future__ import annotations

import math
import multiprocessing
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config import parse_run_config
from dpcfl_flwr.privacy import (
    DEFAULT_ORDERS,
    PrivacyBudget,
    PrivacyLedger,
    metric_release_cost,
    noisy_evaluation,
)
from dpcfl_flwr.protocol import (
    ARRAYS,
    BAD_REQUEST,
    BUDGET_EXCEEDED,
    CONFIG,
    METRICS,
    SELECT,
    SILO,
    SILO_FAILED,
    UPDATE,
    cluster_key,
    metrics_of,
    model_records,
    one_record,
    pack_state,
)
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo import Schedule

N = 80  # training records of the silo
EPSILON, DELTA = 4.0, 1e-5
ROUNDS = 5


def _node_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A deployed silo's own settings, as its silo file gives them."""
    return {"partition-id": 1, "epsilon": EPSILON, "delta": DELTA,
            "ledger-path": str(tmp_path / "silo" / "ledger.json"), "clusters": "1,1",
            "samples-per-client": N, "val-fraction": 0.25, "test-samples": 40,
            "data-seed": 3, **extra}


def _run_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """What the server proposes; in deployment it must not reach the silo's privacy."""
    return parse_run_config({"clusters": "1,1", "num-server-rounds": ROUNDS, "epsilon": EPSILON,
                             "out-dir": str(tmp_path / "server"), **extra}).to_run_config()


def _schedule(**changes: Any) -> dict[str, Any]:
    values = {"rounds": ROUNDS, "local_epochs": 1, "batch_size": 32, "first_batch": "full",
              "select_rounds": 2, "select_ratio": 0.03, "conversion": "classic",
              "budget_mode": "split", "evaluations": 1, **changes}
    return Schedule(**values).to_config()


class Attacker:
    """A server that speaks to one silo's real ClientApp handlers, message by message."""

    def __init__(self, tmp_path: Path, node: dict[str, Any] | None = None,
                 run: dict[str, Any] | None = None) -> None:
        self.tmp_path = tmp_path
        self.context = Context(run_id=11, node_id=501,
                               node_config=node if node is not None else _node_config(tmp_path),
                               state=RecordDict(), run_config=run or _run_config(tmp_path))
        self.model = initial_arrays(parse_run_config(self.context.run_config))
        self.released_updates = 0

    @property
    def ledger_path(self) -> Path:
        return Path(str(self.context.node_config["ledger-path"]))

    def send(self, kind: str, content: RecordDict) -> Message:
        message = Message(content, dst_node_id=501, message_type=kind)
        message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        reply = client_app(message, self.context)
        if not reply.has_error() and UPDATE in model_records(reply.content):
            self.released_updates += 1
            # charged before it left: the ledger on disk already holds this round
            assert len(self.ledger().entries) >= self.released_updates
        return reply

    def query(self) -> Message:
        return self.send("query", RecordDict({CONFIG: ConfigRecord({"server-round": 0})}))

    def train(self, server_round: int, cluster: int = 0, candidates: int = 1,
              **config: Any) -> Message:
        fields = {"server-round": server_round, "stage": "train", "cluster": cluster,
                  "round-batch": "full" if server_round == 1 else "32", "learning-rate": 0.05,
                  "clip-norm": 1.0, **_schedule(), **config}
        fields = {k: v for k, v in fields.items() if v is not None}
        packed = pack_state(self.model.to_torch_state_dict())
        models = ({cluster_key(m): packed for m in range(candidates)} if cluster == SELECT
                  else {ARRAYS: packed})
        return self.send("train", one_record(CONFIG, fields, models))

    def evaluate(self, server_round: int = 5) -> Message:
        packed = pack_state(self.model.to_torch_state_dict())
        return self.send("evaluate", one_record(
            CONFIG, {"server-round": server_round, "cluster": 0}, {ARRAYS: packed}))

    def ledger(self) -> PrivacyLedger:
        return PrivacyLedger.load(self.ledger_path)

    def spent(self) -> float:
        return self.ledger().spent(PrivacyBudget(EPSILON, DELTA))

    def assert_within_budget(self) -> None:
        assert self.spent() <= EPSILON + 1e-9


def _update(reply: Message) -> np.ndarray:
    data = model_records(reply.content)[UPDATE]
    assert isinstance(data, bytes)
    return np.frombuffer(data, dtype="<f4")


def _refused(reply: Message, code: int, *words: str) -> None:
    assert reply.has_error(), "the silo answered instead of refusing"
    assert reply.error.code == code, reply.error.reason
    for word in words:
        assert word in reply.error.reason


# --- item 1: the silo's budget, ledger and split are its own ----------------------------------
@pytest.mark.parametrize("missing", ["delta", "epsilon", "ledger-path"])
def test_a_silo_without_its_own_budget_or_ledger_refuses_to_start(tmp_path, missing,
                                                                  server_task_identity):
    node = _node_config(tmp_path)
    del node[missing]
    attacker = Attacker(tmp_path, node)
    for reply in (attacker.query(), attacker.train(1, cluster=-2)):
        _refused(reply, SILO_FAILED, missing, "must be set in the silo's own node config")
    assert not (tmp_path / "silo").exists() and not (tmp_path / "server").exists()


def test_the_run_config_cannot_change_budget_ledger_split_or_noise(tmp_path,
                                                                     server_task_identity):
    honest = Attacker(tmp_path)
    described = honest.query().content.metric_records[SILO]
    first = metrics_of(honest.train(1, cluster=-2))
    hostile = _run_config(tmp_path, delta=0.5, epsilon=1000.0, seed=99, **{
        "val-fraction": 0.9, "samples-per-client": 5000, "out-dir": str(tmp_path / "fresh"),
        "ledger-dir": str(tmp_path / "fresh-ledgers"), "data-draw": "per-client",
        "metrics": "exact", "metrics-noise": 1e6})
    attacker = Attacker(tmp_path, run=hostile)
    attacker.context.state = honest.context.state
    again = attacker.query().content.metric_records[SILO]
    assert (again["epsilon-budget"], again["delta"], again["num-train"]) == (
        described["epsilon-budget"], described["delta"], described["num-train"]) == (
        EPSILON, DELTA, N)
    second = metrics_of(attacker.train(2, cluster=0))
    assert second["noise-multiplier"] == first["noise-multiplier"]  # the silo's own plan
    assert "val-accuracy" not in second  # its own metrics policy: private
    assert not (tmp_path / "fresh-ledgers").exists() and not (tmp_path / "fresh").exists()
    assert [e.round for e in attacker.ledger().entries] == [1, 2]  # one ledger, both rounds
    attacker.assert_within_budget()


# --- the earlier attacks, which must keep holding ---------------------------------------------
def test_extra_and_repeated_rounds_are_charged_until_the_budget_refuses(tmp_path,
                                                                         server_task_identity):
    attacker = Attacker(tmp_path)
    assert not attacker.train(1, cluster=-2).has_error()
    replies = [attacker.train(2, cluster=0) for _ in range(60)]  # round 2, again and again
    refused = [r for r in replies if r.has_error()]
    assert refused, "60 repeats of a round never ran out of budget"
    _refused(refused[0], BUDGET_EXCEEDED, "refuses round 2")
    answered = len(replies) - len(refused)
    assert len(attacker.ledger().entries) == 1 + answered  # each answered repeat was charged
    assert all(r.has_error() for r in replies[answered:])  # once refused, always refused
    attacker.assert_within_budget()


def test_a_changed_schedule_or_batch_is_refused_or_charged(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)
    attacker.train(1, cluster=-2)
    changed = attacker.train(2, **_schedule(rounds=2))  # fewer rounds: less noise, if obeyed
    _refused(changed, BUDGET_EXCEEDED, "changed the DP schedule")
    bigger = attacker.train(2, **{"round-batch": "80"})  # q = 1 instead of 32/80
    assert not bigger.has_error()
    assert attacker.ledger().entries[-1].sample_rate == 1.0
    many_epochs = attacker.train(3, **{"local-epochs": 50})  # not the planned schedule
    _refused(many_epochs, BUDGET_EXCEEDED, "changed the DP schedule")
    attacker.assert_within_budget()


def test_many_selection_candidates_cost_one_selection(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)
    attacker.train(1, cluster=-2)
    reply = attacker.train(2, cluster=SELECT, candidates=16)  # the default limit
    assert not reply.has_error() and 0 <= metrics_of(reply)["cluster"] < 16
    assert [e.kind for e in attacker.ledger().entries] == ["gaussian", "selection", "gaussian"]
    attacker.assert_within_budget()


@pytest.mark.parametrize("clip", [1e-12, 1e12])
def test_odd_clipping_norms_cost_the_same(tmp_path, clip, server_task_identity):
    attacker = Attacker(tmp_path)
    attacker.train(1, cluster=-2, **{"clip-norm": clip})
    assert not attacker.train(2, **{"clip-norm": clip}).has_error()
    entries = attacker.ledger().entries
    assert len(entries) == 2 and entries[0].noise_multiplier == entries[1].noise_multiplier
    attacker.assert_within_budget()


# --- item 5: malformed requests are refused, nothing charged, nothing released ----------------
@pytest.mark.parametrize(("field", "value"), [
    ("clip-norm", math.nan), ("clip-norm", -1.0), ("learning-rate", math.inf),
    ("round-batch", "0"), ("round-batch", "-3"), ("round-batch", "lots"),
    ("round-batch", "81"), ("local-epochs", 10**9), ("server-round", 0), ("cluster", -9),
    ("rounds", "many"), ("select-ratio", 1.5), ("conversion", "loose"), ("prox-lambda", -1.0),
    ("clip-norm", None),
])
def test_a_bad_field_is_refused_by_name(tmp_path, field, value, server_task_identity):
    attacker = Attacker(tmp_path)
    assert not attacker.train(1, cluster=-2).has_error()
    before = attacker.ledger().to_dict()["entries"]
    reply = attacker.train(2, **{field: value})
    _refused(reply, BAD_REQUEST, f"'{field}'")
    assert attacker.ledger().to_dict()["entries"] == before
    assert not reply.has_content()
    attacker.assert_within_budget()


def test_bad_models_and_a_bad_evaluate_are_refused(tmp_path,
                                                                      server_task_identity):
    attacker = Attacker(tmp_path)
    attacker.train(1, cluster=-2)
    _refused(attacker.train(2, cluster=SELECT, candidates=0), BAD_REQUEST, "cluster-0 ..")
    packed = pack_state(attacker.model.to_torch_state_dict())
    config = {"server-round": 2, "stage": "train", "cluster": SELECT, "round-batch": "32",
              "learning-rate": 0.05, "clip-norm": 1.0, **_schedule()}
    gap = one_record(CONFIG, config, {cluster_key(0): packed, cluster_key(5): packed})
    _refused(attacker.send("train", gap), BAD_REQUEST, "cluster-5")
    nan = pack_state({k: v * math.nan for k, v in attacker.model.to_torch_state_dict().items()})
    _refused(attacker.send("train", one_record(CONFIG, {**config, "cluster": 0},
                                               {ARRAYS: nan})), BAD_REQUEST, "non-finite")
    _refused(attacker.send("train", one_record(CONFIG, {**config, "cluster": 0},
                                               {ARRAYS: packed[:-4]})), BAD_REQUEST, "arrays")
    bad = attacker.send("evaluate", one_record(CONFIG, {"server-round": math.nan,
                                                        "cluster": 0}))
    _refused(bad, BAD_REQUEST, "'server-round'")
    assert len(attacker.ledger().entries) == 1


# --- item 4: metrics are not a free query channel ---------------------------------------------
def test_private_evaluation_is_noised_charged_and_bounded(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)
    replies = [attacker.evaluate() for _ in range(100)]
    answered = [r for r in replies if not r.has_error()]
    accuracies = {float(r.content.metric_records[METRICS]["test-accuracy"]) for r in answered}
    assert len(accuracies) == len(answered) > 1  # fresh noise every time
    assert len(answered) < len(replies)  # repeated queries end in a refusal
    _refused(replies[-1], BUDGET_EXCEEDED)
    entries = attacker.ledger().entries
    assert len(entries) == len(answered)
    assert all((e.noise_multiplier, e.sample_rate, e.steps) == (10.0, 1.0, 1) for e in entries)
    attacker.assert_within_budget()


def test_exact_metrics_are_a_silo_side_opt_in(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, metrics="exact"))
    accuracies = {float(attacker.evaluate().content.metric_records[METRICS]["test-accuracy"])
                  for _ in range(3)}
    assert len(accuracies) == 1 and not attacker.ledger().entries
    trained = metrics_of(attacker.train(1, cluster=-2))
    assert 0.0 <= trained["val-accuracy"] <= 1.0


def test_private_metrics_reserve_budget_for_the_announced_evaluations(tmp_path,
                                                                       server_task_identity):
    exact = Attacker(tmp_path / "exact", _node_config(tmp_path / "exact", metrics="exact"))
    private = Attacker(tmp_path / "private")
    z_exact = metrics_of(exact.train(1, cluster=-2, evaluations=6))["noise-multiplier"]
    z_private = metrics_of(private.train(1, cluster=-2, evaluations=6))["noise-multiplier"]
    assert z_private > z_exact  # six evaluations' worth of budget set aside
    # The whole schedule (two selection rounds in it) and the announced evaluations all fit.
    for server_round in range(2, ROUNDS + 1):
        cluster = SELECT if server_round in (2, 3) else 0
        reply = private.train(server_round, cluster=cluster, candidates=2, evaluations=6)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    for _ in range(6):
        assert not private.evaluate().has_error()
    private.assert_within_budget()


def test_the_evaluation_noise_has_the_charged_scale():
    """Independent check of the mechanism: the released count's noise has std z * sqrt(2) (the
    L2 sensitivity of (correct, clipped loss / bound)), so the ledger's alpha / (2 z^2) holds."""
    generator = torch.Generator().manual_seed(0)
    z, count = 3.0, 1000
    draws = np.array([noisy_evaluation(600, 0.0, count, z, generator)[1] * count
                      for _ in range(20000)])
    assert draws.mean() == pytest.approx(600, abs=0.1)
    assert draws.std() == pytest.approx(z * math.sqrt(2), rel=0.03)
    curve = PrivacyLedger().rdp([metric_release_cost(z, None)])
    assert np.allclose(curve, np.array(DEFAULT_ORDERS) / (2 * z**2))


# --- item 7: a repeated round never reuses a noise draw ----------------------------------------
def test_test_noise_seeds_differ_for_every_charge(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, **{"noise-seed": 5}))
    attacker.train(1, cluster=-2)
    first, again = attacker.train(2), attacker.train(2)
    assert not np.array_equal(_update(first), _update(again))
    # ...and the seed still makes a run reproducible: the same history gives the same draws
    replay = Attacker(tmp_path / "replay", _node_config(tmp_path / "replay",
                                                        **{"noise-seed": 5}))
    replay.train(1, cluster=-2)
    assert np.array_equal(_update(replay.train(2)), _update(first))


# --- item 3: concurrent handlers of one silo serialise on its ledger ----------------------------
def _train_in_another_process(tmp_path: str, barrier: Any, results: Any) -> None:
    from flwr.supercore.task_identity import TaskIdentity  # noqa: PLC0415

    from dpcfl_flwr.config import parse_run_config as parse  # noqa: PLC0415 (child process)

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    torch.set_num_threads(1)
    attacker = Attacker(Path(tmp_path))
    attacker.model = initial_arrays(parse(attacker.context.run_config))
    barrier.wait()
    reply = attacker.train(1, cluster=-2, **_tight_schedule())
    results.put("refused" if reply.has_error() else "trained")


def _tight_schedule() -> dict[str, Any]:
    """One full-batch round of this schedule fits the budget; two do not."""
    return _schedule(rounds=1, select_rounds=0, evaluations=0)


def test_two_processes_cannot_both_spend_the_last_of_the_budget(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_train_in_another_process, args=(str(tmp_path), barrier,
                                                                    results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
        assert worker.exitcode == 0
    outcomes = sorted(results.get(timeout=5) for _ in workers)
    assert outcomes == ["refused", "trained"]
    ledger = PrivacyLedger.load(tmp_path / "silo" / "ledger.json")
    assert len(ledger.entries) == 1
    assert ledger.spent(PrivacyBudget(EPSILON, DELTA)) <= EPSILON
