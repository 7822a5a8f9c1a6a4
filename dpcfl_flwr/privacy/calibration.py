"""Noise calibration: the smallest noise multiplier z whose whole schedule stays within eps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize

from .rdp import DEFAULT_CONVERSION, DEFAULT_ORDERS, Conversion, rdp_to_dp
from .schedule import GaussianPhase, schedule_rdp

# Calibrate to a hair under the target so that the ledger, which sums the same RDP terms in a
# different order (round by round), can never see the planned schedule exceed the budget.
_SAFETY = 1e-9


def schedule_epsilon(
    phases: Sequence[GaussianPhase], noise_multiplier: float, delta: float,
    conversion: Conversion = DEFAULT_CONVERSION, extra_rdp: np.ndarray | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """eps spent by a schedule at noise multiplier z, plus an optional extra RDP curve."""
    rdp = schedule_rdp(phases, noise_multiplier, orders)
    if extra_rdp is not None:
        rdp = rdp + extra_rdp
    return rdp_to_dp(rdp, delta, conversion, orders)[0]


def calibrate_noise_multiplier(
    phases: Sequence[GaussianPhase], target_epsilon: float, delta: float,
    conversion: Conversion = DEFAULT_CONVERSION, extra_rdp: np.ndarray | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    lower: float = 1e-3, upper: float = 1e3, relative_tolerance: float = 1e-7,
) -> float:
    """Solve eps(z) = target for z in [lower, upper] (the authors bisect; we use Brent's
    method) and return a z that provably satisfies eps(z) <= target_epsilon
    (docs/privacy.md#calibrating-z).

    Raises ValueError when even z = ``upper`` cannot meet the target (budget too small or
    the extra RDP, e.g. the selections, already exceeds it).
    """
    def eps(z: float) -> float:
        return schedule_epsilon(phases, z, delta, conversion, extra_rdp, orders)

    return solve_noise_multiplier(eps, target_epsilon, delta, lower, upper, relative_tolerance)


def solve_noise_multiplier(
    eps: Callable[[float], float], target_epsilon: float, delta: float,
    lower: float = 1e-3, upper: float = 1e3, relative_tolerance: float = 1e-7,
    growth: float = 1.0,
) -> float:
    """The smallest z in [lower, upper] with eps(z) <= target_epsilon, for any accountant's
    eps(z) (continuous and decreasing in z). After Brent's method, z is raised by
    ``relative_tolerance`` until the bound holds, the step multiplied by ``growth`` each
    time (1: constant; a discretised accountant, whose eps(z) moves in small jumps, needs
    it to grow)."""
    if target_epsilon <= 0:
        raise ValueError(f"target epsilon must be positive, got {target_epsilon}")
    target = target_epsilon * (1 - _SAFETY)
    if eps(upper) > target:
        raise ValueError(
            f"no noise multiplier up to {upper} meets epsilon={target_epsilon} at delta={delta}: "
            "the budget is too small for this schedule"
        )
    if eps(lower) <= target:
        return lower
    # eps(z) is continuous and decreasing: Brent's method on log z needs ~10 evaluations where
    # plain bisection needs ~30; then step up until the bound provably holds.
    log_z = optimize.brentq(
        lambda t: eps(math.exp(t)) - target, math.log(lower), math.log(upper),
        xtol=relative_tolerance / 10,
    )
    return raise_until_within(eps, math.exp(log_z), target_epsilon, relative_tolerance, growth)


def raise_until_within(eps: Callable[[float], float], noise_multiplier: float,
                       target_epsilon: float, step: float = 1e-7, growth: float = 1.0) -> float:
    """The first of z, z (1 + step), ... (the step multiplied by ``growth`` each time) whose
    eps(z) is within ``target_epsilon`` less the calibration's margin: what makes a
    calibrated z provably fit, whatever found the candidate z."""
    target = target_epsilon * (1 - _SAFETY)
    z = noise_multiplier
    while eps(z) > target:
        z *= 1 + step
        step *= growth
    return z
