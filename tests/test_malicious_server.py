"""The server as an attacker: it writes any run config and any message, and the real ClientApp
handlers (no mocked privacy code) must never release more than the silo's own (epsilon, delta).

Every test ends with the same two checks (:meth:`Attacker.assert_within_budget`): the ledger on
the silo's disk composes to at most its budget, and every update that left the silo was charged
before it left. The silo is a deployed one: its node config holds its budget, ledger and split.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.data import ClientData
from dpcfl_flwr.models import build_model
from dpcfl_flwr.privacy.ledger import PrivacyBudget, PrivacyLedger
from dpcfl_flwr.privacy.metrics import EvaluationSums, metric_release_cost, noisy_release
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS
from dpcfl_flwr.protocol import (
    ANCHOR,
    ARRAYS,
    BAD_REQUEST,
    BUDGET_EXCEEDED,
    CONFIG,
    METRICS,
    ROUND_REPEATED,
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
from dpcfl_flwr.silo.silo import Schedule, Silo
from tests.poisoned_models import plant_canary

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
def test_a_silo_without_its_own_budget_or_ledger_refuses_to_start(tmp_path, missing, caplog,
                                                                  server_task_identity):
    node = _node_config(tmp_path)
    del node[missing]
    attacker = Attacker(tmp_path, node)
    for reply in (attacker.query(), attacker.train(1, cluster=-2)):
        _refused(reply, SILO_FAILED, "the silo's own settings")
        assert missing not in reply.error.reason  # the details are the silo's operator's
    assert f"{missing} must be set in the silo's own node config" in caplog.text
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
def test_a_repeated_round_is_refused_and_new_runs_are_charged_until_the_budget_refuses(
        tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)
    assert not attacker.train(1, cluster=-2).has_error()
    assert not attacker.train(2).has_error()
    # Round 2 of the same run again and again (a resumed run asks so once): refused, free.
    repeats = [attacker.train(2) for _ in range(5)]
    for reply in repeats:
        _refused(reply, ROUND_REPEATED, "already ran and charged train round 2")
    assert len(attacker.ledger().entries) == 2
    # Round 2 of ever new runs (a new run key each time): each is a run the silo plans for
    # what is left, and charges, until its budget refuses.
    replies = [attacker.train(2, **{"run-key": 1000 + i}) for i in range(60)]
    refused = [r for r in replies if r.has_error()]
    assert refused, "60 new runs never ran out of budget"
    _refused(refused[0], BUDGET_EXCEEDED, "")
    answered = len(replies) - len(refused)
    assert len(attacker.ledger().entries) == 2 + answered  # each answered run was charged
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
    # Each query its own round (the same round twice is refused at no cost: below).
    replies = [attacker.evaluate(server_round) for server_round in range(1, 101)]
    answered = [r for r in replies if not r.has_error()]
    accuracies = {float(r.content.metric_records[METRICS]["test-accuracy"]) for r in answered}
    assert len(accuracies) == len(answered) > 1  # fresh noise every time
    assert len(answered) < len(replies)  # repeated queries end in a refusal
    _refused(replies[-1], BUDGET_EXCEEDED)
    entries = attacker.ledger().entries
    assert len(entries) == len(answered)
    assert all((e.noise_multiplier, e.sample_rate, e.steps) == (10.0, 1.0, 1) for e in entries)
    _refused(attacker.evaluate(1), ROUND_REPEATED, "already ran and charged evaluate round 1")
    assert len(attacker.ledger().entries) == len(answered)
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
    for server_round in range(ROUNDS - 5, ROUNDS + 1):
        assert not private.evaluate(server_round).has_error()
    private.assert_within_budget()


def test_the_evaluation_noise_has_the_charged_scale():
    """Independent check of the mechanism: the released count's noise has std z * 2 (the L2
    sensitivity of (correct, clipped loss / bound, per-class correct, per-class count) with
    ten classes), so the ledger's alpha / (2 z^2) holds."""
    generator = torch.Generator().manual_seed(0)
    z, count = 3.0, 1000
    exact = EvaluationSums(count, 600, 0.0, np.full(10, 60), np.full(10, 100))
    draws = np.array([noisy_release(exact, z, generator).accuracy * count
                      for _ in range(20000)])
    assert draws.mean() == pytest.approx(600, abs=0.1)
    assert draws.std() == pytest.approx(z * 2, rel=0.03)
    curve = PrivacyLedger().rdp([metric_release_cost(z, None)])
    assert np.allclose(curve, np.array(DEFAULT_ORDERS) / (2 * z**2))


# --- item 7: a repeated round never reuses a noise draw ----------------------------------------
def test_test_noise_seeds_differ_for_every_charge(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, **{"noise-seed": 5}))
    attacker.train(1, cluster=-2)
    first, again = attacker.train(2), attacker.train(2, **{"run-key": 9})  # another run
    assert not np.array_equal(_update(first), _update(again))
    # ...and the seed still makes a run reproducible: the same history gives the same draws
    replay = Attacker(tmp_path / "replay", _node_config(tmp_path / "replay",
                                                        **{"noise-seed": 5}))
    replay.train(1, cluster=-2)
    assert np.array_equal(_update(replay.train(2)), _update(first))


# --- item 3: concurrent handlers of one silo serialise on its ledger ----------------------------
def _train_in_another_process(tmp_path: str, barrier: Any, results: Any) -> None:
    from flwr.supercore.task_identity import TaskIdentity  # noqa: PLC0415

    from dpcfl_flwr.config.settings import parse_run_config as parse  # noqa: PLC0415 (child process)

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


# --- the server chooses the weights: the NaN canary on every handler path ----------------------
def _fields(server_round: int, cluster: int, batch: str, **extra: Any) -> dict[str, Any]:
    """The config fields of a train message of the schedule, models aside."""
    return {"server-round": server_round, "stage": "train", "cluster": cluster,
            "round-batch": batch, "learning-rate": 0.05, "clip-norm": 1.0, **_schedule(),
            **extra}


def silo_data(attacker: Attacker) -> ClientData:
    """The deployed silo's records, as its own code builds them from its node config."""
    return Silo(parse_node_config(attacker.context.node_config),
                parse_run_config(attacker.context.run_config), 11).data


def _silo_records(attacker: Attacker, split: str) -> torch.Tensor:
    """The deployed silo's records of ``split`` (the attacker's target is one of them)."""
    data = silo_data(attacker)
    return data.x_train if split == "train" else data.x_test


def _poisoned_state(attacker: Attacker, fire: bool, split: str = "train") -> ArrayRecord:
    """The CNN with the canary planted on one of the silo's records (``fire``), or the same
    weights with the detector's threshold above every record: the silo without the target."""
    model = build_model("cnn")
    model.load_state_dict(attacker.model.to_torch_state_dict())
    plant_canary(model, _silo_records(attacker, split), fire=fire)
    return ArrayRecord(model.state_dict())


def _nan_fraction(reply: Message) -> float:
    """The share of NaN values in a reply's update; the update must also have trained (a
    fallback that released the received model would hide the NaN and leak the same bit)."""
    assert not reply.has_error(), reply.error.reason
    update = _update(reply)
    assert np.count_nonzero(update) > 0.5 * update.size
    return float(np.isnan(update).mean())


def _dprivacy_node(tmp_path: Path) -> dict[str, Any]:
    return _node_config(tmp_path, privatiser="dprivacy", **{"dprivacy-noise": 1.0,
                                                             "dprivacy-leakage-budget": 0.0})


def _canary_replies(tmp_path: Path, path: str, fire: bool) -> list[Message]:
    """The replies of one silo, attacked along ``path`` with the poisoned model."""
    node = _dprivacy_node(tmp_path) if path == "dprivacy" else _node_config(tmp_path)
    attacker = Attacker(tmp_path, node)
    poisoned = _poisoned_state(attacker, fire, "test" if path == "evaluate" else "train")
    packed = pack_state(poisoned.to_torch_state_dict())
    if path == "evaluate":
        attacker.model = poisoned
        return [attacker.evaluate(server_round) for server_round in (3, 4, 5)]
    if path == "dprivacy":
        attacker.model = poisoned
        return [attacker.train(1, cluster=-2, privatiser="dprivacy")]
    attacker.train(1, cluster=-2)  # an ordinary first round
    if path == "poisson":  # the target is drawn in a step with probability 1 - (1/80)^2
        attacker.model = poisoned
        return [attacker.train(2, **{"round-batch": str(N - 1)})]
    if path == "selection":
        fields = _fields(2, SELECT, str(N - 1))
        return [attacker.send("train", one_record(CONFIG, fields, {
            cluster_key(0): packed, cluster_key(1): packed}))]
    assert path == "prox"  # MR-MTL: the anchor of the proximal term is poisoned as well
    fields = _fields(2, 0, "full", **{"prox-lambda": 0.5})
    return [attacker.send("train", one_record(CONFIG, fields, {ARRAYS: packed,
                                                               ANCHOR: packed}))]


@pytest.mark.parametrize("path", ["poisson", "selection", "prox", "dprivacy", "evaluate"])
def test_the_nan_canary_changes_no_reply(tmp_path, path, server_task_identity):
    """Weights that overflow on one target record: every reply is the same kind with and
    without the target (answered, finite, charged alike), on every path that sums over
    records. The full-batch round is test_a_full_batch_round_with_the_canary_is_finite."""
    outcomes, norms = [], []
    for fire in (True, False):
        replies = _canary_replies(tmp_path / str(fire), path, fire)
        if path == "evaluate":
            losses = [float(r.content.metric_records[METRICS]["test-loss"]) for r in replies]
            assert all(math.isfinite(loss) for loss in losses)
            outcomes.append(len(losses))
        else:
            outcomes.append([_nan_fraction(r) for r in replies])
            norms.append(float(np.linalg.norm(_update(replies[0]))))
        ledger = PrivacyLedger.load(tmp_path / str(fire) / "silo" / "ledger.json")
        outcomes.append([e.kind for e in ledger.entries])
    assert outcomes[:2] == outcomes[2:]
    if path != "evaluate":
        assert outcomes[0] == [0.0]
        # the target's record counts as zero, the other 79 train as without it; a fallback
        # that kept the received weights would release an update of a far smaller norm
        assert 0.5 < norms[0] / norms[1] < 2.0


def test_a_full_batch_round_with_the_canary_is_finite(tmp_path, server_task_identity):
    """Round 1 sums every record: before the per-record guards, its update was 100% NaN."""
    for fire in (True, False):
        attacker = Attacker(tmp_path / str(fire))
        attacker.model = _poisoned_state(attacker, fire)
        assert _nan_fraction(attacker.train(1, cluster=-2)) == 0.0
        assert len(attacker.ledger().entries) == 1


# --- the work one message causes is bounded ----------------------------------------------------
def _after_round_one(tmp_path: Path) -> tuple[Attacker, bytes, bytes]:
    """A silo that trained round 1, its ledger's bytes, and the model packed."""
    attacker = Attacker(tmp_path)
    attacker.train(1, cluster=-2)
    packed = pack_state(attacker.model.to_torch_state_dict())
    assert isinstance(packed, bytes)
    return attacker, attacker.ledger_path.read_bytes(), packed


def test_ten_thousand_candidates_are_refused_before_any_is_read(tmp_path,
                                                                 server_task_identity):
    attacker, before, packed = _after_round_one(tmp_path)
    fields = _fields(2, SELECT, "32")
    message = one_record(CONFIG, fields, {cluster_key(m): packed for m in range(10_000)})
    tracemalloc.start()
    cpu = time.thread_time()
    reply = attacker.send("train", message)
    cpu = time.thread_time() - cpu
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    _refused(reply, BAD_REQUEST, "10000 cluster models", "'max-candidates'")
    assert cpu < 2.0 and peak < 32 * 2**20  # measured: ~0.02 s of CPU, ~1 MB
    assert attacker.ledger_path.read_bytes() == before


def test_one_malformed_candidate_is_refused_before_any_is_scored(tmp_path,
                                                                  server_task_identity):
    attacker, before, packed = _after_round_one(tmp_path)
    models = {cluster_key(m): packed for m in range(16)}
    models[cluster_key(15)] = packed[:-4]
    fields = _fields(2, SELECT, "32")
    _refused(attacker.send("train", one_record(CONFIG, fields, models)), BAD_REQUEST,
             "cluster-15")
    assert attacker.ledger_path.read_bytes() == before


def test_a_silo_sets_its_own_candidate_limit(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, **{"max-candidates": 2}))
    attacker.train(1, cluster=-2)
    assert not attacker.train(2, cluster=SELECT, candidates=2).has_error()
    _refused(attacker.train(3, cluster=SELECT, candidates=3), BAD_REQUEST, "at most 2")


def test_a_round_beyond_the_silo_step_limit_is_refused(tmp_path, server_task_identity):
    """local-epochs 1000 at batch 1 asks 80,000 DP steps of an 80-record silo; the default
    limit is 10,000 and a silo may set its own."""
    attacker = Attacker(tmp_path)
    reply = attacker.train(1, cluster=-2, **_schedule(local_epochs=1000, batch_size=1),
                           **{"round-batch": "1"})
    _refused(reply, BAD_REQUEST, "80000 DP-SGD steps", "at most 10000", "'max-round-steps'")
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries
    tight = Attacker(tmp_path / "tight", _node_config(tmp_path / "tight",
                                                      **{"max-round-steps": 3}))
    assert not tight.train(1, cluster=-2).has_error()  # the schedule's rounds: 1 and 3 steps
    _refused(tight.train(2, **{"round-batch": "16"}), BAD_REQUEST, "asks 5 DP-SGD steps",
             "at most 3")
    fresh = Attacker(tmp_path / "fresh", _node_config(tmp_path / "fresh",
                                                      **{"max-round-steps": 3}))
    _refused(fresh.train(1, cluster=-2, **_schedule(batch_size=8)), BAD_REQUEST,
             "'batch-size' = 8 asks 10")


def test_a_proximal_step_that_must_diverge_is_refused(tmp_path, server_task_identity):
    """MR-MTL's step scales theta - anchor by 1 - lr lambda: at lr lambda >= 2 it never
    shrinks, so the round would release (and charge) an overflowing update."""
    attacker = Attacker(tmp_path)
    reply = attacker.train(1, cluster=-2, **{"learning-rate": 0.5, "prox-lambda": 5.0})
    _refused(reply, BAD_REQUEST, "'learning-rate' x 'prox-lambda' = 2.5 must stay below 2")
    assert not attacker.ledger_path.exists()
    assert not attacker.train(1, cluster=-2, **{"prox-lambda": 5.0}).has_error()  # lr 0.05


def test_refused_messages_store_no_plan(tmp_path, server_task_identity):
    """200 messages under fresh run keys, each with a malformed model: nothing calibrated,
    nothing stored, the ledger's bytes unchanged."""
    attacker, before, packed = _after_round_one(tmp_path)
    fields = _fields(1, 0, "full")
    cpu = time.thread_time()
    for run_key in range(1000, 1200):
        reply = attacker.send("train", one_record(CONFIG, {**fields, "run-key": run_key},
                                                  {ARRAYS: packed[:-8]}))
        _refused(reply, BAD_REQUEST, "arrays")
    assert time.thread_time() - cpu < 100.0  # ~0.8 s each when a plan was calibrated first
    assert attacker.ledger_path.read_bytes() == before
    assert list(attacker.ledger().meta["runs"]) == ["11"]


@pytest.mark.parametrize("layout", ["renamed", "transposed", "integers", "extra"])
def test_named_arrays_of_another_layout_are_refused_by_name(tmp_path, layout,
                                                             server_task_identity):
    attacker = Attacker(tmp_path)
    state = {k: v.numpy() for k, v in attacker.model.to_torch_state_dict().items()}
    names = list(state)
    if layout == "renamed":
        state = {f"x.{name}": value for name, value in state.items()}
    elif layout == "transposed":
        state[names[0]] = state[names[0]].T.copy()
    elif layout == "integers":
        state[names[0]] = state[names[0]].astype(np.int32)
    else:
        state["extra.weight"] = np.zeros(3, np.float32)
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in state.items()})
    fields = _fields(1, 0, "full")
    content = one_record(CONFIG, fields)
    content[ARRAYS] = record
    _refused(attacker.send("train", content), BAD_REQUEST, "model 'arrays'")
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


# --- what leaves a silo: timing only on the silo's opt-in -------------------------------------
def test_cpu_seconds_leave_a_deployed_silo_only_on_its_opt_in(tmp_path, server_task_identity):
    default = Attacker(tmp_path / "default")
    assert "cpu-seconds" not in metrics_of(default.train(1, cluster=-2))
    opted = Attacker(tmp_path / "opted", _node_config(tmp_path / "opted",
                                                      **{"report-cpu-seconds": True}))
    assert metrics_of(opted.train(1, cluster=-2))["cpu-seconds"] > 0
