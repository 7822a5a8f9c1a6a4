"""The silo's ledger: composition, persistence, budget checks, cross-checked with Opacus."""

from __future__ import annotations

import json

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp

from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger, Selection
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS, rdp_to_dp
from dpcfl_flwr.privacy.schedule import steps_per_round, two_stage_schedule
from dpcfl_flwr.privacy.selection import selection_rdp

DELTA = 1e-4


def _rdpcfl_history(z: float, n: int, b: int, rounds: int) -> list[GaussianSteps]:
    steps = int(steps_per_round(n, b, 1))
    return [GaussianSteps(z, 1.0, 1, round=1)] + [
        GaussianSteps(z, b / n, steps, round=r) for r in range(2, rounds + 1)
    ]


def test_ledger_epsilon_equals_opacus_accountant_fed_the_same_history():
    ledger = PrivacyLedger()
    ledger.record(_rdpcfl_history(1.3, 500, 32, 30))
    accountant = RDPAccountant()
    for entry in ledger.entries:
        accountant.history.append((entry.noise_multiplier, entry.sample_rate, entry.steps))
    theirs = accountant.get_epsilon(DELTA, alphas=list(DEFAULT_ORDERS))
    assert ledger.epsilon(DELTA, "tight", accountant="rdp") == pytest.approx(theirs, rel=1e-6)


def test_ledger_with_selections_matches_independent_composition():
    ledger = PrivacyLedger()
    history = _rdpcfl_history(1.1, 800, 32, 10)
    ledger.record(history)
    ledger.record(Selection(0.3, round=r) for r in range(6, 11))
    # Independently: Opacus' SGM RDP per entry, plus 5 * alpha * eps^2 / 8, classic conversion.
    orders = np.asarray(DEFAULT_ORDERS)
    curve = sum(
        np.asarray(opacus_rdp.compute_rdp(q=e.sample_rate, noise_multiplier=e.noise_multiplier,
                                          steps=e.steps, orders=list(orders)))
        for e in history
    ) + 5 * orders * 0.3**2 / 8
    expected = np.min(curve + np.log(1 / DELTA) / (orders - 1))
    assert ledger.epsilon(DELTA, "classic", accountant="rdp") == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("mode", "conversion"), [("split", "classic"), ("joint", "tight")])
def test_full_planned_rdpcfl_run_fits_the_budget(mode, conversion):
    """Under RDP alone (the default's PLD side: tests/test_pld_accounting.py); the split mode
    as the authors account, the joint one at the default's conversion."""
    n, b, rounds, eps = 500, 32, 30, 10.0
    plan = plan_noise(two_stage_schedule(n, b, 1, rounds), eps, DELTA, select_rounds=3,
                      conversion=conversion, mode=mode, accountant="rdp")
    z = plan.noise_multiplier
    budget = PrivacyBudget(eps, DELTA, conversion, accountant="rdp")
    ledger = PrivacyLedger()
    for entry in _rdpcfl_history(z, n, b, rounds):
        assert not ledger.would_exceed([entry], budget)
        ledger.record([entry])
    for r in range(1, 4):
        selection = Selection(plan.split.epsilon_select, round=rounds + r)
        assert not ledger.would_exceed([selection], budget)
        ledger.record([selection])
    assert ledger.spent(budget) <= eps
    if mode == "split":  # composing in RDP is tighter than adding the two epsilons
        assert ledger.spent(budget) < eps - 0.1
        return
    assert ledger.spent(budget) == pytest.approx(eps, rel=1e-6)
    extra_round = GaussianSteps(z, b / n, int(steps_per_round(n, b, 1)), round=rounds + 1)
    assert ledger.would_exceed([extra_round], budget)


def test_ledger_survives_a_round_trip_through_its_file(tmp_path):
    ledger = PrivacyLedger(meta={"noise_multiplier": 1.25})
    ledger.record(_rdpcfl_history(1.25, 600, 30, 4))
    ledger.record([Selection(0.2, count=2, round=4)])
    path = tmp_path / "silo" / "ledger.json"
    ledger.save(path)
    restored = PrivacyLedger.load(path)
    assert restored.entries == ledger.entries
    assert restored.meta == {"noise_multiplier": 1.25}
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    assert restored.last_round() == 4
    assert json.loads(path.read_text())["format"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["ledger.json"]  # no temp files left


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    first = PrivacyLedger()
    first.record([GaussianSteps(1.0, 1.0, 1, round=1)])
    first.save(path)
    before = path.read_text()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr("os.fsync", broken_fsync)
    second = first.composed(PrivacyLedger([GaussianSteps(1.0, 0.1, 10, round=2)]))
    with pytest.raises(OSError):
        second.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_missing_ledger_starts_empty_but_damaged_one_is_refused(tmp_path):
    assert PrivacyLedger.load(tmp_path / "absent.json").entries == []
    damaged = tmp_path / "ledger.json"
    damaged.write_text('{"format": 1, "entries": [{"kind": "gaussian"')
    with pytest.raises(ValueError, match="refusing to start from an empty budget"):
        PrivacyLedger.load(damaged)


def test_composition_adds_rdp_curves():
    a = PrivacyLedger([GaussianSteps(1.0, 0.05, 100)])
    b = PrivacyLedger([Selection(0.5, count=3)])
    np.testing.assert_allclose(a.composed(b).rdp(), a.rdp() + b.rdp())
    np.testing.assert_allclose(b.rdp(), 3 * selection_rdp(0.5))
    eps, _ = rdp_to_dp(a.rdp() + b.rdp(), DELTA)
    assert a.composed(b).epsilon(DELTA, accountant="rdp") == pytest.approx(eps)


def test_invalid_entries_are_rejected():
    with pytest.raises(ValueError):
        GaussianSteps(0.0, 0.1, 1)
    with pytest.raises(ValueError):
        GaussianSteps(1.0, 1.5, 1)
    with pytest.raises(ValueError):
        Selection(-1.0)
