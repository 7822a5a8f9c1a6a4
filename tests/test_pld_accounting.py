"""PLD accounting (docs/privacy.md#pld-accounting): the figures against dp-accounting's own
accountant and a published value, never above RDP, calibration from below, the ledger's
refusal, and whose accountant a silo uses."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant

from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.privacy import pld as pld_module
from dpcfl_flwr.privacy.accountants import accountant_named
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.calibration import schedule_epsilon
from dpcfl_flwr.privacy.history import History
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger, Selection
from dpcfl_flwr.privacy.pld import pld_epsilon
from dpcfl_flwr.privacy.pld_store import STORE_VARIABLE
from dpcfl_flwr.privacy.schedule import (
    GaussianPhase,
    Schedule,
    single_stage_schedule,
    steps_per_round,
    two_stage_schedule,
)
from dpcfl_flwr.silo.silo import BudgetExceeded, Silo


def accounted_epsilon(runs, selections, delta, accountant, conversion="classic"):
    """The whole history's epsilon by the accountant ``accountant``."""
    return accountant_named(accountant).epsilon(History(tuple(runs), tuple(selections)),
                                                delta, conversion)


DELTA = 1e-4


def _reference(event: dp_accounting.DpEvent, delta: float) -> float:
    """dp-accounting's own PLD accountant, add/remove adjacency, its default grid (1e-4)."""
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("z", "q", "steps"), [
    (1.1, 0.064, 300), (2.0, 0.01, 1000), (0.8, 0.2, 50),  # Poisson-subsampled Gaussian
    (1.3, 1.0, 1), (5.0, 1.0, 100),  # the full batch: a plain Gaussian
])
def test_single_mechanisms_match_dp_accounting(z, q, steps):
    if q == 1.0:
        event: dp_accounting.DpEvent = dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(z), steps)
    else:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    assert pld_epsilon([(z, q, steps)], [], DELTA) == pytest.approx(_reference(event, DELTA),
                                                                   rel=1e-9)


def test_rate_one_steps_at_different_noise_compose_exactly_as_one_gaussian():
    # round 1 at z = 1.2 and 20 private evaluations at z_m = 10
    ours = pld_epsilon([(1.2, 1.0, 1), (10.0, 1.0, 20)], [], DELTA)
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(1.2),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(10.0), 20)])
    assert ours == pytest.approx(_reference(event, DELTA), abs=2e-4)


def test_one_selection_is_the_randomized_response_bound():
    # An eps-DP mechanism's worst case is randomized response: P(o) = e^eps / (1 + e^eps);
    # its delta(e) = P - e^e (1 - P), so eps(delta) = ln((P - delta) / (1 - P)).
    eps = 0.5
    p = math.exp(eps) / (1 + math.exp(eps))
    exact = math.log((p - 1e-3) / (1 - p))
    assert pld_epsilon([], [(eps, 1)], 1e-3) == pytest.approx(exact, abs=2e-4)


def test_published_full_batch_example():
    # a published reference: sigma = 5 over 100 full-batch steps at delta 1e-5: 10.00 by
    # PLD, 10.73 by RDP (Balle et al.'s conversion, the tight one)
    assert pld_epsilon([(5.0, 1.0, 100)], [], 1e-5) == pytest.approx(10.00, abs=0.01)
    rdp = schedule_epsilon([GaussianPhase(1.0, 100)], 5.0, 1e-5, "tight")
    assert rdp == pytest.approx(10.73, abs=0.01)


def _runs(phases, z):
    return [(z, p.sample_rate, p.steps) for p in phases]


@pytest.mark.parametrize(("phases", "z", "selections", "evaluations"), [
    (two_stage_schedule(375, 32, 1, 30), 1.29, [(0.3, 3)], 0),  # the quick example, eps 10
    (two_stage_schedule(375, 32, 1, 30), 3.35, [(0.09, 3)], 7),  # eps 3, private metrics
    (single_stage_schedule(375, 32, 1, 30), 0.9, [], 0),  # a baseline
    (single_stage_schedule(375, 32, 1, 30), 1.1, [(0.3, 3)], 0),  # IFCA
    (two_stage_schedule(8000, 32, 1, 200), 2.12, [], 0),  # the paper's scale, eps 3
])
def test_pld_is_never_above_rdp(phases, z, selections, evaluations):
    runs = _runs(phases, z) + ([(10.0, 1.0, evaluations)] if evaluations else [])
    for conversion in ("classic", "tight"):
        rdp = accounted_epsilon(runs, selections, DELTA, "rdp", conversion)
        assert pld_epsilon(runs, selections, DELTA) < rdp
        assert accounted_epsilon(runs, selections, DELTA, "pld", conversion) < rdp


@pytest.mark.parametrize(("z", "eps_select", "conversion"), [
    (1.09, 0.3, "classic"),  # the paper's eps = 10
    (2.91, 0.09, "tight"),  # the paper's eps = 3, Balle et al.'s conversion
])
def test_many_selections_fall_back_to_the_rdp_figure(z, eps_select, conversion):
    # 20 selections: the pure-DP bound loses more than PLD saves on DP-SGD; the pld
    # accountant then reports the RDP figure of the same history
    runs, selections = _runs(two_stage_schedule(8000, 32, 1, 200), z), [(eps_select, 20)]
    rdp = accounted_epsilon(runs, selections, DELTA, "rdp", conversion)
    assert pld_epsilon(runs, selections, DELTA) > rdp
    assert accounted_epsilon(runs, selections, DELTA, "pld", conversion) == rdp


SMALL = two_stage_schedule(200, 20, 1, 6)  # a fast schedule: 1 full step, 50 at q = 0.1


@pytest.mark.parametrize("mode", ["split", "joint"])
def test_calibration_reaches_the_target_from_below(mode):
    eps, selections = 2.0, 2
    plan = plan_noise(SMALL, eps, DELTA, selections, 0.03, "classic", mode, accountant="pld")
    rdp_plan = plan_noise(SMALL, eps, DELTA, selections, 0.03, "classic", mode, accountant="rdp")
    chosen = [(plan.split.epsilon_select, selections)] if mode == "joint" else []
    target = eps if mode == "joint" else plan.split.epsilon_train

    def spent(z: float) -> float:
        return accounted_epsilon(_runs(SMALL, z), chosen, DELTA, "pld")

    z = plan.noise_multiplier
    assert spent(z) <= target < spent(z * (1 - 1e-3))
    assert z < rdp_plan.noise_multiplier


def test_silos_of_one_process_share_their_calibration_and_their_round_checks():
    """A simulation's silos run in a few processes with equal schedules: the second silo's
    calibration and a ledger's per-round figure are cache hits, and the cached figure is the
    one a fresh composition gives (the key is canonical, however the history is listed)."""
    pld_module._epsilon.cache_clear()
    first = plan_noise(SMALL, 2.0, DELTA, 2, 0.03, accountant="pld").noise_multiplier
    computed = pld_module._epsilon.cache_info().misses
    assert computed > 5  # a calibration tries many z
    assert plan_noise(SMALL, 2.0, DELTA, 2, 0.03, accountant="pld").noise_multiplier == first
    assert pld_module._epsilon.cache_info().misses == computed
    as_rounds = [(first, 1.0, 1)] + [(first, 0.1, 10)] * 5  # a ledger's rounds
    as_schedule = [(first, 0.1, 50), (first, 1.0, 1)]
    assert pld_module.history_key(as_rounds) == pld_module.history_key(as_schedule)
    cached = pld_epsilon(as_rounds, [(0.06, 2)], DELTA)
    fresh = pld_module.history_pld(as_schedule, [(0.06, 2)])
    assert fresh is not None and cached == fresh.get_epsilon_for_delta(DELTA)


def _history(z, n, b, rounds):
    """What an R-DPCFL silo records: round 1 at the full batch, then rounds at b."""
    yield GaussianSteps(z, 1.0, 1, round=1)
    for r in range(2, rounds + 1):
        yield GaussianSteps(z, b / n, int(steps_per_round(n, b, 1)), round=r)


def test_the_ledger_refuses_under_pld_as_before():
    n, b, rounds, eps = 200, 20, 6, 2.0
    plan = plan_noise(two_stage_schedule(n, b, 1, rounds), eps, DELTA, 2, mode="joint",
                      accountant="pld")
    z, budget = plan.noise_multiplier, PrivacyBudget(eps, DELTA, accountant="pld")
    ledger = PrivacyLedger()
    for entry in [*_history(z, n, b, rounds),
                  *(Selection(plan.split.epsilon_select, round=r) for r in (2, 3))]:
        assert not ledger.would_exceed([entry], budget)
        ledger.record([entry])
    assert eps * 0.999 < ledger.spent(budget) <= eps
    # the same history measured by RDP overspends: the pld z is below the RDP one
    assert ledger.spent(PrivacyBudget(eps, DELTA, accountant="rdp")) > eps
    assert ledger.would_exceed([GaussianSteps(z, b / n, 10, round=rounds + 1)], budget)


def test_a_history_too_long_to_compose_is_measured_by_rdp():
    """A server chooses the schedule a silo plans for, and composing 10^7 sampled steps by
    PLD takes minutes: beyond MAX_COMPOSED the pld accountant reports, and calibrates for,
    the RDP figure of the history, also a proven bound."""
    long = single_stage_schedule(80, 1, 125, 100)  # 10^6 steps at q = 1/80
    assert long[0].steps > pld_module.MAX_COMPOSED
    pld, rdp = accountant_named("pld"), accountant_named("rdp")
    assert pld.calibrate(long, 4.0, 1e-5) == rdp.calibrate(long, 4.0, 1e-5)
    history = History(((14.5, 1 / 80, 10**6),), ((0.12, 2),))
    assert pld.epsilon(history, 1e-5) == rdp.epsilon(history, 1e-5)
    # nearly noiseless: 50 full-batch steps at z = 0.1 (a Gaussian of z 0.014), far past
    # any budget, measured by RDP at once
    noiseless = History(((0.1, 1.0, 50),))
    assert pld.epsilon(noiseless, 1e-5) == rdp.epsilon(noiseless, 1e-5) > pld_module.MAX_EPSILON


def test_rdp_schedules_keep_their_key():
    """A schedule names its accountant unless it is rdp, which an unnamed one always meant:
    a run planned before the default became pld keeps its key (and its silos their z)."""
    rdp = Schedule(30, 1, 32, "full", 3, 0.03, "classic", "split", accountant="rdp")
    assert "accountant" not in rdp.to_config()
    pld = Schedule(30, 1, 32, "full", 3, 0.03, "classic", "split", accountant="pld")
    assert pld.to_config()["accountant"] == "pld" and pld.key() != rdp.key()
    assert Schedule(30, 1, 32, "full", 3, 0.03, "tight", "joint").accountant == "pld"


@pytest.fixture()
def experiment(tmp_path):
    def make(accountant: str):
        return parse_run_config({
            "clusters": "1,1", "samples-per-client": 80, "test-samples": 40,
            "num-server-rounds": 3, "epsilon": 4.0, "accountant": accountant,
            "out-dir": str(tmp_path / accountant)})
    return make


@pytest.mark.parametrize(("run", "node", "used"), [
    ("rdp", "pld", "pld"), ("pld", "rdp", "rdp"), ("pld", None, "pld"), ("rdp", None, "rdp"),
])
def test_the_silo_accountant_wins_over_the_run_config(experiment, run, node, used):
    own = {"accountant": node} if node else {}
    silo = Silo(parse_node_config({"partition-id": 1, **own}), experiment(run), 7,
                trust_run_config=True)
    assert silo.budget.accountant == used


def test_a_deployed_silo_without_a_choice_uses_pld(experiment, tmp_path):
    """The default (docs/privacy.md#the-default-accounting), whatever the server proposes."""
    node = {"partition-id": 1, "epsilon": 4.0, "delta": 1e-4,
            "ledger-path": str(tmp_path / "ledger.json")}
    assert Silo(parse_node_config(node), experiment("rdp"), 7).budget.accountant == "pld"


def test_a_pld_silo_plans_records_its_accountant_and_refuses(experiment):
    silo = Silo(parse_node_config({"partition-id": 1, "accountant": "pld"}), experiment("rdp"),
                7, trust_run_config=True)
    schedule = Schedule(3, 1, 16, "full", 1, 0.03, "classic", "joint")
    plan = silo.plan(schedule)
    assert plan.accountant == "pld"
    silo.charge([silo.round_cost(plan, "full", 1, 1)])  # the plan is kept with the charge
    assert silo.ledger.meta["runs"]["7"]["accountant"] == "pld"
    with pytest.raises(BudgetExceeded, match="refuses round 2"):
        silo.check([GaussianSteps(plan.noise_multiplier, 1.0, 20, round=2)], 2)


_RETAINED_AFTER_COMPOSITIONS = """
import ctypes, gc, sys
from dpcfl_flwr.privacy import pld
if sys.argv[1] == "kept":
    pld._release_fft_plans = lambda: None
def anonymous_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
def settle():
    for cached in (pld._sampled_step, pld._sampled_steps, pld._gaussian, pld._pure_dp,
                   pld._epsilon):
        cached.cache_clear()
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
pld.pld_epsilon([(1.0, 0.5, 2)], [], 1e-4)  # warm: the library's own first-use memory
settle()
before = anonymous_kib()
for z in (1.0, 0.9, 1.1, 0.95):  # the quick example's rounds: new lengths each time
    pld.pld_epsilon([(z, 32 / 375, 348), (3.0, 1.0, 1)], [(0.3, 3)], 1e-4)
settle()
print(anonymous_kib() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_compositions_leave_no_fft_plans_behind():
    """dp-accounting's convolutions leave scipy's FFT plans of their lengths cached, 10-17 MB
    each on the 1e-4 grid, and a silo's histories have new lengths every round. After four
    compositions, their PLDs forgotten and the heap trimmed, a process holds little more than
    before; with the plans kept it held ~65 MB more (two fresh processes, same work, each
    composing: no PLD store)."""
    composing = {k: v for k, v in os.environ.items() if k != STORE_VARIABLE}
    retained = {how: int(subprocess.run(
        [sys.executable, "-c", _RETAINED_AFTER_COMPOSITIONS, how], check=True, text=True,
        capture_output=True, cwd=Path(__file__).resolve().parents[1], env=composing).stdout)
        / 1024 for how in ("released", "kept")}
    assert retained["released"] < 20, retained
    assert retained["kept"] > retained["released"] + 30, retained
