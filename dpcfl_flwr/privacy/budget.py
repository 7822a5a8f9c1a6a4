"""A client's total budget eps_total split between training and private cluster selection.

docs/privacy.md#budget-split-and-joint-mode (P7, P8). The authors spend eps_select = ratio *
eps_total per exponential-mechanism selection, charge T_sel selections as alpha *
eps_select^2 / 8 in RDP (zCDP of the exponential mechanism), convert that alone to
eps_clustering, and calibrate DP-SGD to eps_train = eps_total - eps_clustering. Strictly this
composes to (eps_total, 2*delta). The ``joint`` alternative adds the two RDP curves and
converts once, which yields (eps_total, delta) and a smaller z. Either mode runs under
either accountant (``rdp``, or ``pld``: docs/privacy.md#pld-accounting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from .calibration import calibrate_noise_multiplier
from .pld import Accountant, GaussianRun, accounted_epsilon, calibrate_noise_multiplier_pld
from .rdp import DEFAULT_ORDERS, Conversion, rdp_to_dp
from .schedule import GaussianPhase
from .selection import selection_rdp

BudgetMode = Literal["split", "joint"]


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
    accountant: Accountant = "rdp"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_budget(
    epsilon_total: float, delta: float, select_rounds: int, select_ratio: float = 0.03,
    conversion: Conversion = "classic", mode: BudgetMode = "split",
    orders: Sequence[float] = DEFAULT_ORDERS, accountant: Accountant = "rdp",
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
    eps_clustering = 0.0
    if select_rounds and eps_select > 0 and accountant == "pld":
        eps_clustering = accounted_epsilon([], [(eps_select, select_rounds)], delta, "pld",
                                           conversion, orders)
    elif select_rounds and eps_select > 0:
        curve = selection_rdp(eps_select, orders) * select_rounds
        eps_clustering = rdp_to_dp(curve, delta, conversion, orders)[0]
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
    select_rounds: int = 0, select_ratio: float = 0.03, conversion: Conversion = "classic",
    mode: BudgetMode = "split", orders: Sequence[float] = DEFAULT_ORDERS,
    extra_rdp: np.ndarray | None = None, accountant: Accountant = "rdp",
    extra_gaussian: Sequence[GaussianRun] = (),
) -> NoisePlan:
    """Calibrate z for a schedule under eps_total, reserving budget for T_sel selections.

    ``extra_rdp``: the RDP curve (at ``orders``) of other mechanisms the run composes with the
    training, e.g. a silo's private evaluations; they share eps_train (``split``) or the whole
    budget (``joint``) with the DP-SGD steps, composed in RDP. ``accountant = "pld"`` takes
    such mechanisms as ``extra_gaussian`` instead, (z, q, steps), and composes by PLD."""
    split = split_budget(
        epsilon_total, delta, select_rounds, select_ratio, conversion, mode, orders, accountant
    )
    if accountant == "pld":
        if extra_rdp is not None:
            raise ValueError("the pld accountant composes mechanisms, not RDP curves: pass "
                             "extra_gaussian")
        if mode not in ("split", "joint"):
            raise ValueError(f"budget mode must be 'split' or 'joint', got {mode!r}")
        joint = mode == "joint"
        selections = [(split.epsilon_select, select_rounds)] \
            if joint and select_rounds and split.epsilon_select > 0 else []
        z = calibrate_noise_multiplier_pld(
            phases, epsilon_total if joint else split.epsilon_train, delta, conversion,
            extra_gaussian, selections, orders)
    elif extra_gaussian:
        raise ValueError("the rdp accountant takes extra mechanisms as extra_rdp (a curve)")
    elif mode == "joint":
        extra = selection_rdp(split.epsilon_select, orders) * select_rounds
        if extra_rdp is not None:
            extra = extra + extra_rdp
        z = calibrate_noise_multiplier(phases, epsilon_total, delta, conversion, extra, orders)
    elif mode == "split":
        z = calibrate_noise_multiplier(phases, split.epsilon_train, delta, conversion, extra_rdp,
                                       orders)
    else:
        raise ValueError(f"budget mode must be 'split' or 'joint', got {mode!r}")
    return NoisePlan(z, split, tuple(phases))
