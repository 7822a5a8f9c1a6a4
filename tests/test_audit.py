"""The one-run privacy audit (dpcfl_flwr/audit): its bound against binomial tails computed
directly, its level on a mechanism that is exactly eps-DP, and on our DP-SGD: below the
accountant's epsilon with noise, far above it with the noise switched off; ``dpcfl audit``
writes its files and refuses bad input in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from dpcfl_flwr.audit import AuditSettings, audit_bound, guess_membership, p_value, run_audit
from dpcfl_flwr.audit.setting import synthetic_silo
from dpcfl_flwr.cli import app
from dpcfl_flwr.dpsgd.training import DPSGDConfig

# 500 synthetic records, b = 50, 50 rounds of 10 steps (q = 0.1), 2000 canaries with 500
# guesses each way. Measured over seeds 1-3: z = 5 claims 1.81 (PLD, delta 1e-5) and audits
# 0.31-0.53 with noise, 5.04-5.76 without; z = 1 claims 16.6 and audits 2.7-3.1.
NOISELESS_MARGIN = 2.0  # without noise the bound must reach twice the claim


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _audit(z: float, noiseless: bool, seed: int):
    model, x, y = synthetic_silo(500, 0)
    settings = AuditSettings(noise_multiplier=z, batch_size=50, rounds=50, learning_rate=0.5,
                             canaries=2000, guesses=500, noiseless=noiseless)
    return run_audit(model, x, y, settings, seed=seed)


def test_p_value_is_the_binomial_tail_without_delta():
    accuracy = math.exp(1.0) / (1 + math.exp(1.0))
    assert p_value(1000, 200, 150, 1.0, 0.0) == pytest.approx(
        stats.binom.sf(149, 200, accuracy), rel=1e-12)


def test_p_value_delta_term_by_hand():
    # r = 3 guesses, v = 2 correct, eps = 0 (a coin): P[B >= 2] = 4/8; the delta term's
    # maximum over i is i = 1, P[B = 1] / 1 = 3/8 (i = 2: P[B <= 1] / 2 = 1/4).
    assert p_value(10, 3, 2, 0.0, 0.01) == pytest.approx(0.5 + 2 * 10 * 0.01 * 3 / 8)


def test_bound_in_closed_form():
    # All 20 guesses right, delta = 0: the bound is the eps with accuracy^20 = 0.05.
    accuracy = 0.05 ** (1 / 20)
    assert audit_bound(20, 20, 20, 0.0, 0.95) == pytest.approx(
        math.log(accuracy / (1 - accuracy)), abs=1e-5)
    assert audit_bound(1000, 200, 100, 1e-5) == 0.0  # a coin's score proves nothing


def test_bound_holds_its_level_on_randomized_response():
    # Guesses right with probability e^eps / (1 + e^eps): exactly eps-DP, so the bound may
    # exceed eps in at most 5% of audits (here 100; more than 12 has probability ~0.2%).
    rng = np.random.default_rng(0)
    eps, guesses = 1.0, 200
    correct = rng.binomial(guesses, math.exp(eps) / (1 + math.exp(eps)), size=100)
    over = sum(audit_bound(1000, guesses, int(v), 1e-5) > eps for v in correct)
    assert over <= 12


def test_guesses_count_top_and_bottom():
    scores = np.array([5.0, -1.0, 3.0, 0.0, -2.0, 4.0])
    included = np.array([True, False, False, True, False, True])
    outcome = guess_membership(scores, included, 2, 2)
    assert (outcome.made, outcome.correct_in, outcome.correct_out) == (4, 2, 2)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("z", [1.0, 5.0])
def test_audit_stays_below_the_claim_with_noise(z, seed):
    result = _audit(z, noiseless=False, seed=seed)
    assert 0.0 <= result.lower_bound < result.claimed_epsilon
    assert result.passed and result.steps == 500


@pytest.mark.parametrize("seed", [1, 2])
def test_audit_catches_training_without_noise(seed):
    result = _audit(5.0, noiseless=True, seed=seed)
    assert result.lower_bound > NOISELESS_MARGIN * result.claimed_epsilon
    assert not result.passed


def test_silo_configs_still_refuse_no_noise():
    with pytest.raises(ValueError, match="noise multiplier must be positive"):
        DPSGDConfig(0.0, 1.0, 0.1, 32)


def test_cli_writes_json_and_markdown(tmp_path: Path):
    out = tmp_path / "audit"
    run = CliRunner().invoke(app, ["audit", "--out", str(out), "--dataset", "synthetic",
                                   "--records", "200", "--batch", "20", "--rounds", "3",
                                   "--epsilon", "4", "--canaries", "200", "--seed", "3"])
    assert run.exit_code == 0, run.output
    report = json.loads((out / "audit.json").read_text())
    assert report["claimed_epsilon"] == pytest.approx(4.0, rel=1e-3)
    assert 0 <= report["lower_bound"] < report["claimed_epsilon"] and report["passed"]
    assert report["guesses"] == 40 and report["steps"] == 30
    assert "audited lower bound" in (out / "audit.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--noise", "1", "--epsilon", "2"], "exactly one of --noise"),
    (["--noise", "0"], "z must be > 0"),
    (["--noise", "1", "--batch", "999"], "--batch 999"),
    (["--noise", "1", "--canaries", "100000"], "--canaries 100000"),
    (["--noise", "1", "--accountant", "moments"], "--accountant"),
])
def test_cli_refuses_bad_input_in_one_line(tmp_path: Path, args, message):
    run = CliRunner().invoke(app, ["audit", "--out", str(tmp_path), "--dataset", "synthetic",
                                   *args])
    assert run.exit_code == 2
    assert message in run.output and run.output.count("error:") == 1
