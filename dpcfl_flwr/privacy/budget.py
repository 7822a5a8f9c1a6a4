"""A client's total budget eps_total shared between training and private cluster selection.

docs/privacy.md#budget-split-and-joint-mode (P7, P8). Every selection spends eps_select =
ratio * eps_total. ``joint`` (the default, :mod:`.defaults`) composes the T_sel selections
with the DP-SGD schedule into one history and calibrates z so that the whole converts once to
eps_total: (eps_total, delta), and the run as planned spends its whole budget. ``split`` is
the authors': T_sel selections charged as alpha * eps_select^2 / 8 in RDP (zCDP of the
exponential mechanism) and converted alone to eps_clustering, DP-SGD calibrated to eps_train
= eps_total - eps_clustering; strictly (eps_total, 2*delta), and since the two parts compose
to less than their sum, a split run ends below its budget. Either mode runs under either
accountant (``pld``, ``rdp``: docs/privacy.md#pld-accounting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .accountants import DEFAULT_ACCOUNTANT, AccountantName, accountant_named
from .defaults import DEFAULT_BUDGET_MODE, BudgetMode
from .history import EMPTY, History
from .rdp import DEFAULT_CONVERSION, DEFAULT_ORDERS, Conversion
from .schedule import GaussianPhase


@dataclass(frozen=True)
class BudgetSplit:
    """eps_total -> (eps_select per selection, eps_clustering for T_sel of them, eps_train)."""

    epsilon_total: float
    delta: float
    select_rounds: int
    epsilon_select: float
    epsilon_clustering: float
    epsilon_train: float
    conversion: Conversion
    mode: BudgetMode
    accountant: AccountantName = DEFAULT_ACCOUNTANT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_budget(
    epsilon_total: float, delta: float, select_rounds: int, select_ratio: float = 0.03,
    conversion: Conversion = DEFAULT_CONVERSION, mode: BudgetMode = DEFAULT_BUDGET_MODE,
    orders: Sequence[float] = DEFAULT_ORDERS, accountant: AccountantName = DEFAULT_ACCOUNTANT,
) -> BudgetSplit:
    """Divide eps_total (docs/privacy.md#reference-values). In ``joint`` mode eps_clustering
    and eps_train are not separately meaningful; they are reported as the selections' own
    conversion and the remainder, for reading only."""
    if epsilon_total <= 0:
        raise ValueError(f"epsilon must be positive, got {epsilon_total}")
    if select_rounds < 0:
        raise ValueError(f"select rounds must be >= 0, got {select_rounds}")
    if not 0.0 <= select_ratio < 1.0:
        raise ValueError(f"select ratio must lie in [0, 1), got {select_ratio}")
    eps_select = select_ratio * epsilon_total
    eps_clustering = accountant_named(accountant).epsilon(
        History.of_selections(eps_select, select_rounds), delta, conversion, orders)
    eps_train = epsilon_total - eps_clustering
    if eps_train <= 0:
        raise ValueError(
            f"{select_rounds} selections at eps_select={eps_select:.4g} cost "
            f"eps={eps_clustering:.4g}, leaving nothing of eps_total={epsilon_total} for "
            "training: lower --select-ratio or --select-rounds"
        )
    return BudgetSplit(
        epsilon_total, delta, select_rounds, eps_select, eps_clustering, eps_train, conversion,
        mode, accountant
    )


@dataclass(frozen=True)
class NoisePlan:
    """What a client commits to before training: its z and the budget behind it."""

    noise_multiplier: float
    split: BudgetSplit
    phases: tuple[GaussianPhase, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "split": self.split.to_dict(),
            "phases": [asdict(p) for p in self.phases],
        }


def plan_noise(
    phases: Sequence[GaussianPhase], epsilon_total: float, delta: float,
    select_rounds: int = 0, select_ratio: float = 0.03,
    conversion: Conversion = DEFAULT_CONVERSION, mode: BudgetMode = DEFAULT_BUDGET_MODE,
    orders: Sequence[float] = DEFAULT_ORDERS, history: History = EMPTY,
    accountant: AccountantName = DEFAULT_ACCOUNTANT,
) -> NoisePlan:
    """Calibrate z for a schedule under eps_total, reserving budget for T_sel selections.

    ``history``: other mechanisms the run composes with the training, e.g. a silo's private
    evaluations; they share eps_train (``split``) or the whole budget (``joint``) with the
    DP-SGD steps. ``accountant`` measures it all (:mod:`.accountants`)."""
    if mode not in ("split", "joint"):
        raise ValueError(f"budget mode must be 'split' or 'joint', got {mode!r}")
    split = split_budget(
        epsilon_total, delta, select_rounds, select_ratio, conversion, mode, orders, accountant
    )
    if mode == "joint":
        extra = History.of_selections(split.epsilon_select, select_rounds) + history
        target = epsilon_total
    else:
        extra, target = history, split.epsilon_train
    z = accountant_named(accountant).calibrate(phases, target, delta, conversion, extra, orders)
    return NoisePlan(z, split, tuple(phases))
