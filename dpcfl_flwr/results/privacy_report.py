"""What ``dpcfl privacy noise`` prints: one accountant's noise plan, or RDP's and PLD's side
by side for the same schedule (docs/privacy.md#pld-accounting)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from ..privacy.accountants import accountant_named
from ..privacy.budget import BudgetMode, NoisePlan, plan_noise
from ..privacy.history import ACCOUNTANTS, History
from ..privacy.rdp import Conversion
from ..privacy.schedule import GaussianPhase


def plan_dict(plan: NoisePlan) -> dict[str, Any]:
    """A plan as the command's JSON reports it: the plan and its z rounded up to 2 dp."""
    return {**plan.to_dict(),
            "noise_multiplier_2dp_up": math.ceil(plan.noise_multiplier * 100) / 100}


def schedule_epsilon_at(phases: Sequence[GaussianPhase], noise_multiplier: float, delta: float,
                        selections: int, epsilon_select: float, conversion: Conversion
                        ) -> dict[str, float]:
    """Epsilon of the whole schedule and its selections at one z, composed jointly, by each
    accountant (``pld``: as the ledger measures it, never above ``rdp``)."""
    history = (History(tuple((noise_multiplier, p.sample_rate, p.steps) for p in phases))
               + History.of_selections(epsilon_select, selections))
    return {name: accountant_named(name).epsilon(history, delta, conversion)
            for name in ACCOUNTANTS}


def compare_accountants(phases: Sequence[GaussianPhase], epsilon: float, delta: float,
                        select_rounds: int, select_ratio: float, conversion: Conversion,
                        mode: BudgetMode, at_z: float | None = None) -> dict[str, Any]:
    """Both accountants' plans for one schedule, and both epsilons at ``at_z`` (default:
    the RDP z, i.e. what the RDP plan really spends by PLD)."""
    plans = {accountant: plan_noise(phases, epsilon, delta, select_rounds, select_ratio,
                                    conversion, mode, accountant=accountant)
             for accountant in ACCOUNTANTS}
    z = at_z if at_z is not None else plans["rdp"].noise_multiplier
    eps_select = plans["rdp"].split.epsilon_select
    return {**{name: plan_dict(plan) for name, plan in plans.items()}, "at_z": z,
            "epsilon_at_z": schedule_epsilon_at(phases, z, delta, select_rounds, eps_select,
                                                conversion)}


def authors_noise_multiplier(phases: Sequence[GaussianPhase], epsilon: float, delta: float,
                             select_rounds: int, select_ratio: float) -> float | None:
    """z for the same schedule under the authors' accounting (``split``, ``classic``,
    ``rdp``: :data:`~..privacy.defaults.AUTHORS_ACCOUNTING`), to set a plan beside theirs;
    None when their split leaves nothing for training."""
    try:
        return plan_noise(phases, epsilon, delta, select_rounds, select_ratio, "classic",
                          "split", accountant="rdp").noise_multiplier
    except ValueError:
        return None


def _print_authors(console: Console, result: dict[str, Any]) -> None:
    z = result.get("authors_noise_multiplier")
    console.print("the authors' accounting (budget mode split, conversion classic, rdp): "
                  + (f"z = {z:.4f}" if z is not None else "no z fits (their split leaves "
                     "nothing for training)") + " for the same schedule and budget",
                  highlight=False)


def _schedule_text(phases: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['steps']:g} steps at q={p['sample_rate']:.4g}" for p in phases)


def print_noise_table(console: Console, result: dict[str, Any], with_selection: bool) -> None:
    """One accountant's plan (the command without ``--accountant pld``)."""
    split = result["split"]
    table = Table(title="DP-SGD noise calibration", show_header=False)
    table.add_row("noise multiplier z", f"{result['noise_multiplier']:.4f}")
    table.add_row("z rounded up (2 dp)", f"{result['noise_multiplier_2dp_up']:.2f}")
    table.add_row("schedule", _schedule_text(result["phases"]))
    table.add_row("epsilon total / delta", f"{split['epsilon_total']:g} / {split['delta']:g}")
    table.add_row("conversion", split["conversion"])
    if with_selection:
        table.add_row("budget mode", split["mode"])
        table.add_row("eps_select (per selection)", f"{split['epsilon_select']:.4f}")
        table.add_row("selections T_sel", str(split["select_rounds"]))
        if split["mode"] == "split":  # joint: no separate shares
            table.add_row("eps_clustering", f"{split['epsilon_clustering']:.4f}")
            table.add_row("eps_train", f"{split['epsilon_train']:.4f}")
    console.print(table)
    _print_authors(console, result)


def print_comparison(console: Console, result: dict[str, Any], with_selection: bool) -> None:
    """RDP's and PLD's plans side by side (``--accountant pld``)."""
    rdp, pld = result["rdp"], result["pld"]
    table = Table(title="DP-SGD noise calibration: RDP and PLD")
    table.add_column("")
    table.add_column("RDP", justify="right")
    table.add_column("PLD", justify="right")
    table.add_row("noise multiplier z", f"{rdp['noise_multiplier']:.4f}",
                  f"{pld['noise_multiplier']:.4f}")
    table.add_row("z rounded up (2 dp)", f"{rdp['noise_multiplier_2dp_up']:.2f}",
                  f"{pld['noise_multiplier_2dp_up']:.2f}")
    if with_selection and rdp["split"]["mode"] == "split":  # joint: no separate shares
        for key in ("epsilon_clustering", "epsilon_train"):
            table.add_row(key.replace("epsilon", "eps"), f"{rdp['split'][key]:.4f}",
                          f"{pld['split'][key]:.4f}")
    spent = result["epsilon_at_z"]
    table.add_row(f"epsilon spent at z = {result['at_z']:.4f}", f"{spent['rdp']:.4f}",
                  f"{spent['pld']:.4f}")
    split = rdp["split"]
    console.print(table)
    console.print(f"schedule: {_schedule_text(rdp['phases'])}; epsilon {split['epsilon_total']:g}"
                  f", delta {split['delta']:g}, conversion {split['conversion']}"
                  + (f", budget mode {split['mode']}, {split['select_rounds']} selections at "
                     f"eps_select {split['epsilon_select']:.4f}" if with_selection else ""),
                  highlight=False)
    console.print("a silo with the pld accountant uses PLD's z: its epsilon of a history is the "
                  "smaller of the two bounds (docs/privacy.md#pld-accounting)", highlight=False)
    _print_authors(console, result)
