"""A silo's private choice of its learning rate (docs/algorithm.md#choosing-the-learning-rate):
one model trained per candidate, one released, every model and the selection charged, the
plan calibrated for it from the first message; the server sends the chosen rate after."""

from __future__ import annotations

import math

import pytest

from dpcfl_flwr.config.settings import STEP_LENGTHS, parse_run_config
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.schedule import round_phase, two_stage_schedule
from dpcfl_flwr.protocol import BAD_REQUEST, metrics_of
from tests.test_malicious_server import (
    DELTA,
    EPSILON,
    ROUNDS,
    Attacker,
    N,
    _node_config,
    _refused,
    _schedule,
)

CANDIDATES = "0.01,0.03,0.1"


def test_the_choosing_round_charges_every_candidate_and_one_selection(tmp_path,
                                                                      server_task_identity):
    attacker = Attacker(tmp_path)
    planned = _schedule(**{"tune_candidates": 3, "evaluations": 0})  # no metric reserve
    assert not attacker.train(1, cluster=-2, **planned).has_error()
    reply = attacker.train(2, **planned, **{"learning-rate-candidates": CANDIDATES})
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    chosen = metrics_of(reply)["learning-rate"]
    assert any(math.isclose(chosen, float(c)) for c in CANDIDATES.split(","))
    entries = attacker.ledger().entries
    assert [e.kind for e in entries] == ["gaussian"] * 4 + ["selection"]
    assert {e.round for e in entries[1:]} == {2}
    assert len({(e.sample_rate, e.steps) for e in entries[1:4]}) == 1
    # the plan: this schedule's phases, plus two more rounds, two selections (one planned,
    # one the choice's), calibrated by an independent call
    n = N  # the attacked silo's training records
    phases = two_stage_schedule(n, 32, 1, ROUNDS, "full") + [round_phase(n, 32, 1, 2)]
    z = plan_noise(phases, EPSILON, DELTA, 2 + 1, 0.03, "classic", "split",
                   accountant="pld").noise_multiplier
    assert entries[0].noise_multiplier == pytest.approx(z, rel=1e-9)
    attacker.assert_within_budget()


@pytest.mark.parametrize(("planned", "candidates", "words"), [
    (0, CANDIDATES, "plans 0"),
    (2, CANDIDATES, "plans 2"),
    (3, "0.1,0.1,-1", "positive"),
    (9, "0.01,0.1", "'tune-candidates'"),
])
def test_candidates_the_plan_does_not_hold_are_refused_uncharged(
        tmp_path, planned, candidates, words, server_task_identity):
    attacker = Attacker(tmp_path)
    reply = attacker.train(2, **_schedule(**{"tune_candidates": planned}),
                           **{"learning-rate-candidates": candidates})
    _refused(reply, BAD_REQUEST, words)
    assert not attacker.ledger_path.exists()


def test_a_d_privacy_silo_does_not_choose(tmp_path, server_task_identity):
    node = _node_config(tmp_path, **{"privatiser": "dprivacy", "dprivacy-noise": 1.0,
                                     "dprivacy-leakage-budget": 100.0})
    attacker = Attacker(tmp_path, node)
    reply = attacker.train(2, privatiser="dprivacy", **_schedule(**{"tune_candidates": 3}),
                           **{"learning-rate-candidates": CANDIDATES})
    _refused(reply, BAD_REQUEST, "d-privacy")


def test_the_run_config_sets_a_rate_or_the_rule_gives_the_candidates():
    default = parse_run_config({})
    assert default.tuned_learning_rates == tuple(s / 3.0 for s in STEP_LENGTHS)
    assert default.base_learning_rate == pytest.approx(math.sqrt(0.015 * 0.5) / 3.0)
    assert parse_run_config({"clip-norm": 1.0}).tuned_learning_rates == STEP_LENGTHS
    assert parse_run_config({"learning-rate": 0.02}).tuned_learning_rates == ()
    given = parse_run_config({"learning-rate-candidates": "0.3,0.1"})
    assert given.tuned_learning_rates == (0.1, 0.3)
    with pytest.raises(ValueError, match="2 to 8"):
        parse_run_config({"learning-rate-candidates": "0.1"})
