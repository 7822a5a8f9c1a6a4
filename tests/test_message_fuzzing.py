"""Property-based fuzzing of the messages a server may send (Hypothesis): train, evaluate and
query messages whose every field is valid, junk, missing or out of range, with models that are
right, truncated, NaN, of another layout, too many or absent, in short sequences to one
deployed silo's real ClientApp handlers.

Every message must end in one of two ways: a documented refusal (BAD_REQUEST,
BUDGET_EXCEEDED, or ROUND_REPEATED for a round of a run answered before in the sequence) that
leaves the ledger as it was, or a reply whose ledger charge is what an
independent recomputation from the message's fields says (the DP-SGD steps and rate of the
round, a selection when asked, one Gaussian release per private evaluation), with the total
spend within the silo's budget by Google's dp-accounting, and bounded CPU time.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dpcfl_flwr.client_app import _run_name
from dpcfl_flwr.privacy.ledger import GaussianSteps
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
    UPDATE,
    cluster_key,
    metrics_of,
    model_records,
    one_record,
    pack_state,
)
from tests.test_malicious_server import DELTA, EPSILON, ROUNDS, Attacker, _node_config

N = 40  # the fuzzed silo's training records: every valid round trains for real, quickly
#: CPU seconds one message may take here; a real round of 40 records takes well under one
CPU_LIMIT = 60.0

# CI draws the same examples every run; DPCFL_FUZZ=long draws ten times as many, at random
settings.register_profile("ci", max_examples=100, derandomize=True)
settings.register_profile("quick", max_examples=40)
settings.register_profile("long", max_examples=400)
settings.load_profile(os.environ.get("DPCFL_FUZZ") or ("ci" if os.environ.get("CI") else "quick"))

JUNK = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(allow_nan=True),
    st.text(max_size=6), st.booleans(), st.just(10**9), st.just(-1),
)
VALID_TRAIN = {
    "server-round": st.integers(1, ROUNDS),
    "cluster": st.sampled_from([0, 1, SELECT, -2, -3]),
    "round-batch": st.sampled_from(["full", "1", "8", "32", str(N), str(N + 1)]),
    "learning-rate": st.floats(1e-4, 1.0),
    "clip-norm": st.floats(1e-3, 10.0),
    "rounds": st.integers(1, ROUNDS),
    "local-epochs": st.integers(1, 2),
    "batch-size": st.sampled_from([4, 16, 32, N]),
    "first-batch": st.sampled_from(["full", "16"]),
    "select-rounds": st.integers(0, 2),
    "select-ratio": st.floats(0.0, 0.5),
    "conversion": st.sampled_from(["classic", "tight"]),
    "budget-mode": st.sampled_from(["split", "joint"]),
    "evaluations": st.integers(0, 3),
    "run-key": st.integers(0, 3),
    "personal": st.integers(0, 1),
    "prox-lambda": st.floats(0.0, 1.0),
    "privatiser": st.sampled_from(["dpsgd"] * 5 + ["dprivacy"]),
    "tune-candidates": st.sampled_from([0, 0, 2, 3, 9]),
    "learning-rate-candidates": st.sampled_from(["", "", "0.01,0.1", "0.01,0.03,0.1",
                                                 "0.1,-1", "0.1,0.5,1,2,3,4,5,6,7"]),
}
MODEL_KINDS = ["valid"] * 6 + ["truncated", "nan", "none", "renamed", "anchor", "anchor"]


@st.composite
def fields(draw: st.DrawFn, valid: dict[str, st.SearchStrategy]) -> dict[str, Any]:
    """Every field valid (half the messages), or each field valid, junk or missing."""
    perturbed = draw(st.booleans())
    out = {}
    for key, good in valid.items():
        choice = draw(st.sampled_from(["valid"] * 8 + ["junk", "missing"])) if perturbed \
            else "valid"
        if choice != "missing":
            out[key] = draw(good if choice == "valid" else JUNK)
    return out


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, int]:
    """(kind, fields, model kind, number of candidates) of one message."""
    kind = draw(st.sampled_from(["train", "train", "train", "evaluate", "query"]))
    if kind == "evaluate":
        valid = {"server-round": st.integers(0, ROUNDS), "cluster": st.sampled_from([0, -3])}
        return kind, draw(fields(valid)), draw(st.sampled_from(MODEL_KINDS)), 1
    candidates = draw(st.one_of(st.integers(1, 3), st.integers(0, 18)))
    return kind, draw(fields(VALID_TRAIN)), draw(st.sampled_from(MODEL_KINDS)), candidates


def _models(attacker: Attacker, model_kind: str, candidates: int, cluster: Any
            ) -> dict[str, Any]:
    state = attacker.model.to_torch_state_dict()
    packed = pack_state(state)
    if model_kind == "none":
        return {}
    if model_kind == "truncated":
        packed = packed[:-4]
    elif model_kind == "nan":
        packed = pack_state({k: v * math.nan for k, v in state.items()})
    elif model_kind == "renamed":
        packed = ArrayRecord({f"x{k}": Array(v.numpy()) for k, v in state.items()})
    if cluster == SELECT:
        return {cluster_key(m): packed for m in range(candidates)}
    models = {ARRAYS: packed}
    if model_kind == "anchor":
        models[ANCHOR] = packed
    return models


def _send(attacker: Attacker, kind: str, values: dict[str, Any], model_kind: str,
          candidates: int) -> Any:
    if kind == "query":
        return attacker.send("query", RecordDict({CONFIG: ConfigRecord({"server-round": 0})}))
    fields_ = {"stage": "train", **values} if kind == "train" else values
    models = _models(attacker, model_kind, candidates, values.get("cluster"))
    content = one_record(CONFIG, fields_, {k: v for k, v in models.items()
                                           if isinstance(v, bytes)})
    for name, model in models.items():
        if isinstance(model, ArrayRecord):
            content[name] = model
    return attacker.send(kind, content)


def _expected_train_charge(values: dict[str, Any]) -> tuple[float, int, bool, int]:
    """(sample rate, steps, with a selection, models trained) of an answered train message,
    from its fields alone: b/N and K ceil(N/b) at an integer batch, rate 1 and K steps at
    the full batch; one model, or one per learning-rate candidate (then a selection more)."""
    batch = N if values["round-batch"] == "full" else int(values["round-batch"])
    rates = [r for r in str(values.get("learning-rate-candidates", "")).split(",") if r]
    return (batch / N, values["local-epochs"] * math.ceil(N / batch),
            values["cluster"] == SELECT, max(1, len(rates)))


def _dp_accounting_epsilon(entries: list[Any]) -> float:
    """Google's accountants on the ledger's Gaussian entries (selections excluded: they only
    add to the spend, so this is a lower bound of what the ledger must stay within): the
    smaller of its RDP and its PLD figure, as the silo's default accountant (pld) reports the
    smaller of the two bounds (docs/privacy.md#pld-accounting)."""
    rdp = dp_accounting.rdp.RdpAccountant()
    pld = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for entry in entries:
        if isinstance(entry, GaussianSteps):
            event = dp_accounting.PoissonSampledDpEvent(
                entry.sample_rate, dp_accounting.GaussianDpEvent(entry.noise_multiplier))
            rdp.compose(event, entry.steps)
            pld.compose(dp_accounting.SelfComposedDpEvent(event, entry.steps))
    return min(rdp.get_epsilon(DELTA), pld.get_epsilon(DELTA))


def _check(attacker: Attacker, kind: str, values: dict[str, Any], reply: Any,
           before: list[Any]) -> None:
    after = attacker.ledger().entries if attacker.ledger_path.exists() else []
    event(f"{kind}: " + (f"refused {reply.error.code}" if reply.has_error() else "answered"))
    if reply.has_error():
        assert reply.error.code in (BAD_REQUEST, BUDGET_EXCEEDED, ROUND_REPEATED), \
            reply.error.reason
        assert "\n" not in reply.error.reason  # one line
        assert after == before
        return
    new = after[len(before):]
    if kind == "query":
        assert SILO in reply.content and not new
        return
    if kind == "evaluate":
        assert METRICS in reply.content
        assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in new] == [(10.0, 1.0, 1)]
        return
    rate, steps, selected, trained = _expected_train_charge(values)
    assert [e.kind for e in new] == ((["selection"] if selected else []) + ["gaussian"] * trained
                                     + (["selection"] if trained > 1 else []))
    gaussians = [e for e in new if e.kind == "gaussian"]
    assert {(g.sample_rate, g.steps, g.round) for g in gaussians} == {
        (rate, steps, values["server-round"])}
    metrics = metrics_of(reply)
    assert metrics["noise-multiplier"] == gaussians[0].noise_multiplier
    assert "cpu-seconds" not in metrics
    if not values.get("personal"):
        update = model_records(reply.content)[UPDATE]
        assert np.isfinite(np.frombuffer(update, dtype="<f4")).all()
    # 1e-3: dp-accounting composes full-batch steps of several rounds on its grid, where the
    # silo composes them exactly as one Gaussian (docs/privacy.md#pld-accounting)
    assert _dp_accounting_epsilon(after) <= EPSILON + 1e-3


@pytest.mark.slow
@settings(deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sequence=st.lists(messages(), min_size=1, max_size=3))
def test_every_message_is_refused_or_charged_as_recomputed(sequence, server_task_identity
                                                           ) -> None:
    with tempfile.TemporaryDirectory() as folder:
        node = _node_config(Path(folder), **{"samples-per-client": N, "test-samples": 20})
        attacker = Attacker(Path(folder), node)
        charged: set[tuple[str, int, Any]] = set()  # (kind, run key, round) answered
        for kind, values, model_kind, candidates in sequence:
            before = attacker.ledger().entries if attacker.ledger_path.exists() else []
            run = _run_of(attacker, kind, values)
            cpu = time.thread_time()
            reply = _send(attacker, kind, values, model_kind, candidates)
            assert time.thread_time() - cpu < CPU_LIMIT
            _check(attacker, kind, values, reply, before)
            round_of_run = (kind, run, values.get("server-round"))
            if reply.has_error() and reply.error.code == ROUND_REPEATED:
                assert round_of_run in charged, reply.error.reason  # only what was charged
            elif not reply.has_error() and kind != "query":
                charged.add(round_of_run)


def _run_of(attacker: Attacker, kind: str, values: dict[str, Any]) -> int:
    """The run a silo counts a message's round in: a train message's run key (0: the Flower
    run's id), an evaluation's the run of the silo's first answered train message."""
    if kind == "evaluate":
        return _run_name(attacker.context)
    key = values.get("run-key")
    return key if isinstance(key, int) and key > 0 else attacker.context.run_id
