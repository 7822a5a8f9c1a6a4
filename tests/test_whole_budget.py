"""The default accounting (docs/privacy.md#the-default-accounting) puts the whole budget to
work, and no more: a deployed silo's real ClientApp handlers, driven through one run as the
default run config plans it, end within 1% of the silo's epsilon, and the spend its ledger
records is the one dp-accounting and Opacus give, computed here independently of
dpcfl_flwr/privacy."""

from __future__ import annotations

import math
from dataclasses import replace

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import optimize, stats

from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.methods.base import ServerState
from dpcfl_flwr.methods.rdpcfl import RDPCFL
from dpcfl_flwr.privacy.defaults import AUTHORS_ACCOUNTING
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger, Selection
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS
from dpcfl_flwr.protocol import BUDGET_EXCEEDED, SELECT, metrics_of
from dpcfl_flwr.silo.silo import BudgetExceeded, Schedule, Silo
from tests.test_malicious_server import DELTA, EPSILON, ROUNDS, Attacker, _refused

SELECTION_ROUNDS = (4, 5)  # R-DPCFL's window: the last rounds select privately, then train


def _default_schedule(tmp_path, select_rounds: int = len(SELECTION_ROUNDS)) -> dict:
    """The schedule a server running the default run config announces."""
    run = parse_run_config({"clusters": "1,1", "num-server-rounds": ROUNDS,
                            "out-dir": str(tmp_path / "server")})
    assert (run.budget_mode, run.conversion, run.accountant) == ("joint", "tight", "pld")
    return Schedule(ROUNDS, 1, 32, "full", select_rounds, 0.03, run.conversion,
                    run.budget_mode, evaluations=1, accountant=run.accountant).to_config()


def _run(attacker: Attacker, schedule: dict) -> list:
    """Every round of the plan (a selection between two candidates in the window), then the
    announced private evaluation; the replies."""
    replies = []
    for server_round in range(1, ROUNDS + 1):
        selecting = server_round in SELECTION_ROUNDS
        replies.append(attacker.train(server_round, SELECT if selecting else 0,
                                      2 if selecting else 1, **schedule))
    replies.append(attacker.evaluate(ROUNDS))
    return replies


def _pld_reference(ledger: PrivacyLedger, delta: float) -> float:
    """dp-accounting's own accountant for the Gaussian steps; the selections as k-fold
    randomized response, whose privacy loss is +-eps_select (Binomial), composed exactly:
    delta(eps) = sum_l P(L_sel = l) delta_Gaussian(eps - l)."""
    accountant = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    selections: list[float] = []
    for entry in ledger.entries:
        if isinstance(entry, Selection):
            selections += [entry.epsilon] * entry.count
            continue
        assert isinstance(entry, GaussianSteps)
        step: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(entry.noise_multiplier)
        if entry.sample_rate < 1:
            step = dp_accounting.PoissonSampledDpEvent(entry.sample_rate, step)
        accountant.compose(dp_accounting.SelfComposedDpEvent(step, entry.steps))
    assert len(set(selections)) == 1  # one eps_select per run
    k, e = len(selections), selections[0]
    wins = stats.binom(k, math.exp(e) / (1 + math.exp(e)))

    def excess(eps: float) -> float:
        return sum(wins.pmf(j) * accountant.get_delta(eps - (2 * j - k) * e)
                   for j in range(k + 1)) - delta

    return float(optimize.brentq(excess, 0.01, 50.0, xtol=1e-9))


def _rdp_reference(ledger: PrivacyLedger, delta: float) -> float:
    """Opacus' sampled-Gaussian RDP per entry, the selections as alpha eps^2 / 8 (zCDP of the
    exponential mechanism), Opacus' conversion (Balle et al., the tight one)."""
    orders = np.asarray(DEFAULT_ORDERS)
    curve = np.zeros_like(orders)
    for entry in ledger.entries:
        if isinstance(entry, Selection):
            curve += entry.count * orders * entry.epsilon**2 / 8
        else:
            curve += opacus_rdp.compute_rdp(q=entry.sample_rate,
                                            noise_multiplier=entry.noise_multiplier,
                                            steps=entry.steps, orders=list(orders))
    eps, _ = opacus_rdp.get_privacy_spent(orders=list(orders), rdp=curve, delta=delta)
    return float(eps)


def test_a_default_run_ends_within_one_percent_of_its_budget_and_verifies(
        tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)
    replies = _run(attacker, _default_schedule(tmp_path))
    assert not any(reply.has_error() for reply in replies)
    ledger = attacker.ledger()
    kinds = [type(e).__name__ for e in ledger.entries]
    assert kinds.count("Selection") == len(SELECTION_ROUNDS) and len(kinds) == ROUNDS + 3
    spent = ledger.spent(PrivacyBudget(EPSILON, DELTA, "tight", "pld"))
    assert 0.99 * EPSILON <= spent <= EPSILON
    assert metrics_of(replies[-1])["epsilon-spent"] == pytest.approx(spent, rel=1e-12)
    # The figure is the smaller of two proven bounds of the same history, each recomputed
    # here from the ledger's entries alone; the split accounting would have ended near 0.9 eps.
    pld, rdp = _pld_reference(ledger, DELTA), _rdp_reference(ledger, DELTA)
    assert spent == pytest.approx(min(pld, rdp), abs=2e-3)
    assert pld < rdp  # here PLD is the tighter one (few selections, a small silo)


def test_selections_left_out_of_the_plan_are_refused_at_the_budget(tmp_path,
                                                                    server_task_identity):
    """The default plans to spend the whole budget, so a server that announces no selection
    (a smaller z, if the silo reserved nothing for them) and then asks for them finds the
    budget spent: a selection round is refused, nothing overspends."""
    attacker = Attacker(tmp_path)
    replies = _run(attacker, _default_schedule(tmp_path, select_rounds=0))
    refused = [reply for reply in replies if reply.has_error()]
    assert refused
    _refused(refused[0], BUDGET_EXCEEDED, "refuses round")
    attacker.assert_within_budget()


def _whole_schedule(silo: Silo, plan, schedule: Schedule, first_round: int) -> list:
    """Every mechanism of ``schedule`` as the silo charges it, from ``first_round`` on."""
    rounds = range(first_round, first_round + schedule.rounds)
    entries: list = [silo.round_cost(plan, "full" if r == first_round else schedule.batch_size,
                                     r, schedule.local_epochs) for r in rounds]
    return entries + [Selection(plan.epsilon_select, round=r)
                      for r in list(rounds)[-schedule.select_rounds:]]


def test_an_authors_ledger_is_measured_whole_and_the_next_run_fills_the_budget(tmp_path):
    """A deployed silo's ledger holds a run planned the authors' way (split, classic, rdp).
    Under the default the silo measures that history whole by its own accountant; resumed
    under its key, the old run keeps its z; a new run fits into what is left and ends within
    1% of the budget."""
    ledger = tmp_path / "ledger.json"
    node = parse_node_config({"partition-id": 1, "epsilon": EPSILON, "delta": DELTA,
                              "ledger-path": str(ledger), "clusters": "1,1",
                              "samples-per-client": 80, "test-samples": 40})
    runs = {}
    for name, accounting in (("authors", AUTHORS_ACCOUNTING), ("default", {})):
        experiment = parse_run_config({"clusters": "1,1", "num-server-rounds": ROUNDS,
                                       "rdpcfl.select-window": 0.4,
                                       "out-dir": str(tmp_path / name), **accounting})
        method = RDPCFL(experiment, experiment.methods["rdpcfl"],
                        ServerState(np.zeros(1, np.float32)))
        runs[name] = (experiment, replace(method.schedule(), accountant=experiment.accountant))
    experiment, schedule = runs["authors"]
    old = Silo(node.model_copy(update={"accountant": "rdp"}), experiment, 1)
    old_plan = old.plan(schedule)
    old.charge(_whole_schedule(old, old_plan, schedule, 1))
    old.persist()
    by_rdp = old.spent()
    assert by_rdp < 0.95 * EPSILON  # the authors' split leaves budget unspent

    resumed = Silo(node, experiment, 1)  # the default accountant now, the old run's key
    assert resumed.budget.accountant == "pld"
    assert resumed.plan(schedule).noise_multiplier == old_plan.noise_multiplier
    assert resumed.spent() <= by_rdp  # the same history, measured whole by PLD

    experiment, schedule = runs["default"]
    new = Silo(node, experiment, 2)
    plan = new.plan(schedule)
    assert plan.accountant == "pld" and plan.noise_multiplier > old_plan.noise_multiplier
    for entry in _whole_schedule(new, plan, schedule, ROUNDS + 1):
        new.check([entry], entry.round)
        new.charge([entry])
    assert 0.99 * EPSILON <= new.spent() <= EPSILON


def test_a_silo_with_run_epsilon_spends_that_per_run_until_its_budget_is_spent(tmp_path):
    """``run-epsilon`` (the silo's own setting) is what one run plans to spend: two whole runs
    end at half the budget and at the budget, each within 1%, each run's selections taking
    their share of its half; a third run finds nothing left and is refused."""
    half = EPSILON / 2
    node = parse_node_config({"partition-id": 1, "epsilon": EPSILON, "delta": DELTA,
                              "run-epsilon": half, "ledger-path": str(tmp_path / "l.json"),
                              "clusters": "1,1", "samples-per-client": 80,
                              "test-samples": 40})
    experiment = parse_run_config({"clusters": "1,1", "num-server-rounds": ROUNDS,
                                   "rdpcfl.select-window": 0.4, "out-dir": str(tmp_path)})
    schedule = RDPCFL(experiment, experiment.methods["rdpcfl"],
                      ServerState(np.zeros(1, np.float32))).schedule()
    plans = []
    for run, ends_at in ((1, half), (2, EPSILON)):
        silo = Silo(node, experiment, run)
        plans.append(silo.plan(schedule))
        for entry in _whole_schedule(silo, plans[-1], schedule, 1 + (run - 1) * ROUNDS):
            silo.check([entry], entry.round)
            silo.charge([entry])
        silo.persist()
        assert 0.99 * ends_at <= silo.spent() <= ends_at
    assert plans[1].epsilon_select == pytest.approx(plans[0].epsilon_select, rel=0.02)
    assert plans[0].epsilon_select == pytest.approx(0.03 * half, rel=1e-9)
    with pytest.raises(BudgetExceeded, match="no noise level fits the remaining budget: "
                       r"earlier runs spent epsilon [\d.]+ of 4, this run may end at 4 "):
        Silo(node, experiment, 3).plan(schedule)
