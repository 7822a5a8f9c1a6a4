"""The accountant against the authors' reference tables (docs/privacy.md#reference-values) and
against Opacus."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp

from dpcfl_flwr.privacy.budget import plan_noise, split_budget
from dpcfl_flwr.privacy.calibration import calibrate_noise_multiplier, schedule_epsilon
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS, rdp_to_dp, sgm_rdp, sgm_rdp_single
from dpcfl_flwr.privacy.schedule import single_stage_schedule, two_stage_schedule

DELTA = 1e-4

# docs/privacy.md#reference-values: N_i, b, eps -> z single-stage, z two-stage (K=1, E=200,
# delta=1e-4, unrounded)
NOISE_TABLE = [
    (8000, 32, 15, 0.6678, 0.7115), (8000, 32, 10, 0.7733, 0.8646),
    (8000, 32, 5, 1.0907, 1.3805), (8000, 32, 3, 1.5447, 2.1196),
    (10000, 32, 15, 0.6403, 0.6837), (10000, 32, 10, 0.7348, 0.8268),
    (10000, 32, 5, 1.0141, 1.3161), (10000, 32, 3, 1.4128, 2.0215),
    (10000, 64, 5, 1.2887, 1.5511), (6600, 32, 5, 1.1652, 1.4441),
    (6600, 32, 10, 0.8104, 0.9011),
]

# docs/privacy.md#reference-values: eps_total -> eps_select, eps_clustering, eps_train
# (T_sel = 20, ratio 0.03)
SPLIT_TABLE = [
    (15, 0.45, 4.8251, 10.1749), (10, 0.30, 3.1041, 6.8959), (5, 0.15, 1.4960, 3.5040),
    (4, 0.12, 1.1876, 2.8124), (3, 0.09, 0.8841, 2.1159), (2, 0.06, 0.5848, 1.4152),
]

# docs/privacy.md#reference-values: (N, b R-DPCFL, b baselines, eps_total) -> z R-DPCFL,
# z IFCA, z Global (2 decimals)
METHOD_TABLE = [
    (8000, 32, 32, 15, 0.86, 0.77, 0.67), (8000, 32, 32, 10, 1.09, 0.91, 0.77),
    (8000, 32, 32, 5, 1.85, 1.38, 1.09), (8000, 32, 32, 4, 2.24, 1.62, 1.26),
    (8000, 32, 32, 3, 2.91, 2.04, 1.54), (10000, 32, 64, 15, 0.82, 0.86, 0.74),
    (10000, 32, 64, 10, 1.04, 1.06, 0.87), (10000, 32, 64, 5, 1.76, 1.67, 1.29),
    (10000, 32, 64, 4, 2.14, 1.99, 1.51), (10000, 32, 64, 3, 2.77, 2.53, 1.88),
]


@pytest.mark.parametrize(("n", "b", "eps", "z_single", "z_two"), NOISE_TABLE)
def test_calibration_reproduces_reference_noise_table(n, b, eps, z_single, z_two):
    single = single_stage_schedule(n, b, epochs=1, rounds=200, exact=False)
    two = two_stage_schedule(n, b, epochs=1, rounds=200, exact=False)
    # the authors' accountant converts classically (the default is tight: docs/privacy.md)
    assert calibrate_noise_multiplier(single, eps, DELTA, "classic") == pytest.approx(
        z_single, abs=1e-3)
    assert calibrate_noise_multiplier(two, eps, DELTA, "classic") == pytest.approx(z_two,
                                                                                   abs=1e-3)


@pytest.mark.parametrize(("eps", "eps_select", "eps_clustering", "eps_train"), SPLIT_TABLE)
def test_budget_split_reproduces_reference_table(eps, eps_select, eps_clustering, eps_train):
    split = split_budget(eps, DELTA, select_rounds=20, select_ratio=0.03, conversion="classic",
                         mode="split", accountant="rdp")
    assert split.epsilon_select == pytest.approx(eps_select, abs=1e-9)
    assert split.epsilon_clustering == pytest.approx(eps_clustering, abs=1e-3)
    assert split.epsilon_train == pytest.approx(eps_train, abs=1e-3)


@pytest.mark.parametrize(("n", "b_r", "b_base", "eps", "z_r", "z_ifca", "z_global"), METHOD_TABLE)
def test_per_method_noise_multipliers_match_reference(n, b_r, b_base, eps, z_r, z_ifca, z_global):
    authors = {"conversion": "classic", "mode": "split", "accountant": "rdp"}  # not the default
    rdpcfl = plan_noise(two_stage_schedule(n, b_r, 1, 200, exact=False), eps, DELTA, 20,
                        **authors)
    ifca = plan_noise(single_stage_schedule(n, b_base, 1, 200, exact=False), eps, DELTA, 20,
                      **authors)
    glob = plan_noise(single_stage_schedule(n, b_base, 1, 200, exact=False), eps, DELTA,
                      **authors)
    # The table is rounded half-up to 2 decimals by the authors' code.
    assert round(rdpcfl.noise_multiplier, 2) == pytest.approx(z_r, abs=1e-3)
    assert round(ifca.noise_multiplier, 2) == pytest.approx(z_ifca, abs=1e-3)
    assert round(glob.noise_multiplier, 2) == pytest.approx(z_global, abs=1e-3)


@pytest.mark.parametrize(("q", "z"), [(0.004, 1.85), (0.064, 0.6), (0.5, 1.2), (0.02, 3.0)])
def test_sgm_rdp_matches_opacus_analysis(q, z):
    ours = sgm_rdp(q, z, steps=7, orders=DEFAULT_ORDERS)
    theirs = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=7, orders=list(DEFAULT_ORDERS))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_full_batch_rdp_is_the_gaussian_mechanism():
    # q = 1: no amplification, RDP = alpha / (2 z^2) per step (docs/privacy.md, P2).
    z = 1.37
    np.testing.assert_allclose(
        sgm_rdp(1.0, z, 3, DEFAULT_ORDERS), 3 * np.asarray(DEFAULT_ORDERS) / (2 * z * z)
    )


def test_tight_conversion_matches_opacus_and_is_below_classic():
    curve = sgm_rdp(0.004, 1.1, 50_000, DEFAULT_ORDERS)
    tight, _ = rdp_to_dp(curve, DELTA, "tight")
    classic, _ = rdp_to_dp(curve, DELTA, "classic")
    theirs, _ = opacus_rdp.get_privacy_spent(orders=list(DEFAULT_ORDERS), rdp=curve, delta=DELTA)
    assert tight == pytest.approx(theirs, rel=1e-12)
    assert tight < classic


def test_calibrated_noise_never_exceeds_the_target():
    schedule = two_stage_schedule(500, 32, epochs=1, rounds=30)
    for eps in (1.0, 3.0, 10.0):
        for conversion in ("classic", "tight"):
            z = calibrate_noise_multiplier(schedule, eps, DELTA, conversion)
            assert schedule_epsilon(schedule, z, DELTA, conversion) <= eps
            assert schedule_epsilon(schedule, z * (1 - 1e-4), DELTA, conversion) > eps


def test_first_round_full_batch_costs_more_noise_at_small_epsilon():
    # docs/privacy.md#the-full-batch-round: N=8000, eps=3: single-stage 1.54 -> two-stage 2.12.
    single = calibrate_noise_multiplier(single_stage_schedule(8000, 32, 1, 200), 3, DELTA,
                                        "classic")
    two = calibrate_noise_multiplier(two_stage_schedule(8000, 32, 1, 200), 3, DELTA, "classic")
    assert two / single == pytest.approx(2.1196 / 1.5447, rel=1e-3)


def test_joint_budget_is_tighter_than_the_split():
    schedule = two_stage_schedule(8000, 32, 1, 200)
    split = plan_noise(schedule, 5.0, DELTA, select_rounds=20, mode="split", accountant="rdp")
    joint = plan_noise(schedule, 5.0, DELTA, select_rounds=20, mode="joint", accountant="rdp")
    assert joint.noise_multiplier < split.noise_multiplier


def test_budget_too_small_for_the_selections_is_refused():
    with pytest.raises(ValueError, match="leaving nothing"):
        split_budget(0.5, DELTA, select_rounds=200, select_ratio=0.5, accountant="rdp")


def test_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="too small"):
        calibrate_noise_multiplier(single_stage_schedule(100, 10, 1, 10), 1e-9, DELTA)


def test_integer_and_fractional_orders_agree_around_an_integer():
    # The two series of Mironov et al. must meet continuously at integer orders.
    below = sgm_rdp(0.01, 1.3, 1, [4.999999])[0]
    at = sgm_rdp(0.01, 1.3, 1, [5.0])[0]
    assert math.isclose(below, at, rel_tol=1e-4)


def test_rdp_accountant_history_matches_schedule_epsilon():
    accountant = RDPAccountant()
    z = 1.2
    accountant.history = [(z, 1.0, 1), (z, 32 / 8000, 250 * 199)]
    theirs = accountant.get_epsilon(DELTA, alphas=list(DEFAULT_ORDERS))
    ours = schedule_epsilon(two_stage_schedule(8000, 32, 1, 200), z, DELTA, "tight")
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_a_remembered_curve_is_the_computed_one_and_callers_cannot_change_it():
    first = sgm_rdp(0.064, 1.18, 16, DEFAULT_ORDERS)  # computed (or remembered from above)
    direct = np.array([sgm_rdp_single(0.064, 1.18, a) for a in DEFAULT_ORDERS]) * 16
    assert np.array_equal(first, direct)
    first *= 0  # the caller owns its result
    assert np.array_equal(sgm_rdp(0.064, 1.18, 16, list(DEFAULT_ORDERS)), direct)
    # equal floats of another type name the same curve; another order grid is another curve
    assert np.array_equal(sgm_rdp(np.float64(0.064), 1.18, 16, DEFAULT_ORDERS), direct)
    assert sgm_rdp(0.064, 1.18, 16, DEFAULT_ORDERS[:5]).shape == (5,)
