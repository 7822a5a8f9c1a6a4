"""A history of mechanisms run on one silo's records, in the form both accountants read.

Composition is the same under either accountant: the history lists every mechanism, and an
accountant (:mod:`.accountants`, which this module names) turns the whole list into one
epsilon. A history is built
from a ledger (:meth:`~.ledger.PrivacyLedger.history`), from a planned schedule, or both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .defaults import ACCOUNTANTS, DEFAULT_ACCOUNTANT, UNNAMED_ACCOUNTANT, AccountantName
from .rdp import sgm_rdp
from .selection import selection_rdp

__all__ = ["ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "EMPTY", "UNNAMED_ACCOUNTANT", "AccountantName",
           "GaussianRun", "History", "SelectionRun"]

#: (noise multiplier z, sample rate q, steps): ``steps`` Gaussian steps, Poisson rate q.
GaussianRun = tuple[float, float, float]
#: (epsilon_select, count): ``count`` epsilon-DP exponential-mechanism selections.
SelectionRun = tuple[float, float]


@dataclass(frozen=True)
class History:
    """Gaussian runs and exponential-mechanism selections, in the order they were recorded."""

    gaussian: tuple[GaussianRun, ...] = ()
    selections: tuple[SelectionRun, ...] = ()

    def __add__(self, other: History) -> History:
        """Both histories on the same records (composition)."""
        return History(self.gaussian + other.gaussian, self.selections + other.selections)

    def __bool__(self) -> bool:
        return bool(self.gaussian or self.selections)

    @classmethod
    def of_selections(cls, epsilon: float, count: int) -> History:
        """``count`` selections at ``epsilon`` (none when either is 0)."""
        return cls(selections=((epsilon, count),)) if count and epsilon > 0 else cls()

    def rdp(self, orders: Sequence[float]) -> np.ndarray:
        """The RDP curve at ``orders`` (P1, P2, P4): the selections in order, then one
        sampled-Gaussian curve per distinct (z, q) with its steps summed, so a long ledger
        costs one curve per noise level and a plan and a ledger of the same mechanisms sum
        the same terms in the same order."""
        total = np.zeros(len(orders))
        for epsilon, count in self.selections:
            total = total + selection_rdp(epsilon, orders) * count
        steps: dict[tuple[float, float], float] = {}
        for z, q, n in self.gaussian:
            steps[(z, q)] = steps.get((z, q), 0) + n
        for (z, q), n in steps.items():
            total = total + sgm_rdp(q, z, n, orders)
        return total


#: The history of no mechanism (a default argument).
EMPTY = History()
