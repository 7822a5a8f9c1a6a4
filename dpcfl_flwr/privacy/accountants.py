"""The two accountants behind one interface, chosen once by name (docs/privacy.md).

An accountant answers two questions about a :class:`~.history.History` of mechanisms on one
silo's records: what epsilon it spends at a delta, and the smallest noise multiplier z at
which a schedule of DP-SGD phases, on top of a history, stays within a target epsilon.

- ``rdp``: the history's RDP curve (P1, P2, P4) converted to (epsilon, delta) once (P5, P6).
- ``pld``: privacy loss distributions through Google's dp-accounting (:mod:`.pld`); it
  reports the smaller of its figure and the RDP one, both upper bounds of the same history.

This module is the only place that tells the two apart: a silo's node config, a run config
and the audit name an accountant, and everything else asks :func:`accountant_named` for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from .calibration import calibrate_noise_multiplier, raise_until_within, solve_noise_multiplier
from .history import ACCOUNTANTS, DEFAULT_ACCOUNTANT, EMPTY, AccountantName, History
from .pld import (
    MAX_EPSILON,
    SEARCH_DISCRETIZATION,
    VALUE_DISCRETIZATION,
    composable,
    pld_epsilon,
)
from .rdp import DEFAULT_CONVERSION, DEFAULT_ORDERS, Conversion, rdp_to_dp
from .schedule import GaussianPhase


class Accountant(ABC):
    """Measures a history's spend and calibrates z for a schedule."""

    name: ClassVar[AccountantName]

    @abstractmethod
    def epsilon(self, history: History, delta: float, conversion: Conversion = DEFAULT_CONVERSION,
                orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        """Epsilon at ``delta`` of the whole ``history`` (0 when it holds no mechanism)."""

    @abstractmethod
    def calibrate(self, phases: Sequence[GaussianPhase], target_epsilon: float, delta: float,
                  conversion: Conversion = DEFAULT_CONVERSION, history: History = EMPTY,
                  orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        """The smallest z at which ``phases`` (DP-SGD at z) composed with ``history`` spend at
        most ``target_epsilon`` (docs/privacy.md#calibrating-z); ValueError when no z does."""


class RdpAccountant(Accountant):
    """RDP composition, converted once."""

    name = "rdp"

    def epsilon(self, history: History, delta: float, conversion: Conversion = DEFAULT_CONVERSION,
                orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        if not history:
            return 0.0
        return rdp_to_dp(history.rdp(orders), delta, conversion, orders)[0]

    def calibrate(self, phases: Sequence[GaussianPhase], target_epsilon: float, delta: float,
                  conversion: Conversion = DEFAULT_CONVERSION, history: History = EMPTY,
                  orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        extra = history.rdp(orders) if history else None
        return calibrate_noise_multiplier(phases, target_epsilon, delta, conversion, extra,
                                          orders)


class PldAccountant(Accountant):
    """PLD composition (:mod:`.pld`), never above the RDP figure."""

    name = "pld"

    def epsilon(self, history: History, delta: float, conversion: Conversion = DEFAULT_CONVERSION,
                orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        return self._epsilon(history, delta, conversion, orders, VALUE_DISCRETIZATION)

    @staticmethod
    def _epsilon(history: History, delta: float, conversion: Conversion,
                 orders: Sequence[float], grid: float) -> float:
        """The figure on a PLD ``grid`` of that many nats (:mod:`.pld`)."""
        if not history:
            return 0.0
        rdp = RdpAccountant().epsilon(history, delta, conversion, orders)
        if rdp > MAX_EPSILON or not composable(history.gaussian, history.selections):
            return rdp  # too long or too noiseless to compose by PLD here: RDP's bound
        return min(pld_epsilon(history.gaussian, history.selections, delta, grid), rdp)

    def calibrate(self, phases: Sequence[GaussianPhase], target_epsilon: float, delta: float,
                  conversion: Conversion = DEFAULT_CONVERSION, history: History = EMPTY,
                  orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        """The RDP z of the same history meets the target (this figure is never above the
        RDP one) and bounds the search from above; PLDs of very small z would need huge grids,
        so the lower end is found by stepping down from there instead of starting at 0.001.
        The search runs on the coarse grid (:data:`~.pld.SEARCH_DISCRETIZATION`, ~8x cheaper
        an evaluation); its answer is then checked, and raised if need be, on the grid that
        measures spends, usually at one evaluation: the plan ends at most ~0.2% of epsilon
        short of the budget instead of costing 5-16 s of CPU."""
        upper = RdpAccountant().calibrate(phases, target_epsilon, delta, conversion, history,
                                          orders)
        planned = History(tuple((upper, p.sample_rate, p.steps) for p in phases)) + history
        if not composable(planned.gaussian, planned.selections):
            return upper  # measured by RDP alone at every z (:meth:`epsilon`)

        def on_grid(grid: float) -> Callable[[float], float]:
            def eps(z: float) -> float:
                runs = History(tuple((z, p.sample_rate, p.steps) for p in phases))
                return self._epsilon(runs + history, delta, conversion, orders, grid)
            return eps

        coarse = on_grid(SEARCH_DISCRETIZATION)
        lower = upper
        for _ in range(12):  # RDP's z is rarely more than 1.3 x PLD's; 0.8^12 = 0.07
            lower *= 0.8
            if coarse(lower) > target_epsilon:
                break
        candidate = solve_noise_multiplier(coarse, target_epsilon, delta, lower, upper,
                                           relative_tolerance=1e-5, growth=2.0)
        return min(raise_until_within(on_grid(VALUE_DISCRETIZATION), candidate,
                                      target_epsilon, step=1e-5, growth=2.0), upper)


_ACCOUNTANTS: dict[str, Accountant] = {a.name: a for a in (RdpAccountant(), PldAccountant())}
assert tuple(_ACCOUNTANTS) == ACCOUNTANTS


def accountant_named(name: str) -> Accountant:
    """The accountant ``name`` (``rdp`` or ``pld``); ValueError naming the choices."""
    if name not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")
    return _ACCOUNTANTS[name]


__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "Accountant", "AccountantName", "PldAccountant",
           "RdpAccountant", "accountant_named"]
