"""The one-run audit's statistics: from correct membership guesses to a lower bound on epsilon.

Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run", Theorem 5.2 and
their Appendix D: m canaries are each included independently with probability 1/2; after
training an auditor guesses "in" or "out" for r of them and abstains on the rest. If the
training is (eps, delta)-DP with respect to each canary (add/remove, the adjacency of our
accountant, docs/privacy.md#adjacency), the number W of correct guesses satisfies, for every v,

    P[W >= v] <= beta(eps, v) + 2 m delta * max_{1 <= i <= v} P[v - i <= B <= v - 1] / i
    beta(eps, v) = P[B >= v],   B ~ Binomial(r, e^eps / (1 + e^eps))

e^eps / (1 + e^eps) being the accuracy of eps-DP randomized response, the best any eps-DP
guesser can do on one canary. The right-hand side is the p-value of the observation W = v under
the hypothesis "(eps, delta)-DP"; the audit's lower bound at confidence 1 - alpha is the largest
eps that this test still rejects at level alpha.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, stats

# The search steps eps up from 0 in these increments until the hypothesis is no longer
# rejected, then refines the crossing with Brent's method (see audit_bound).
_SCAN_STEP = 0.05
_SCAN_LIMIT = 100.0


def _check(canaries: int, guesses: int, correct: int, delta: float) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries "
                         f"({canaries})")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must lie in [0, 1), got {delta}")


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[at least ``correct`` of ``guesses`` guesses right] under (epsilon, delta)-DP with
    ``canaries`` randomised canaries: the bound of the module docstring, capped at 1."""
    _check(canaries, guesses, correct, delta)
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    accuracy = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))
    if delta == 0.0 or correct == 0:
        return min(tail, 1.0)
    # P[v - i <= B <= v - 1] for i = 1..v is a running sum of the pmf from v - 1 downwards.
    below = np.cumsum(stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, accuracy))
    worst = float(np.max(below / np.arange(1, correct + 1)))
    return min(tail + 2.0 * canaries * delta * worst, 1.0)


def audit_bound(canaries: int, guesses: int, correct: int, delta: float,
                confidence: float = 0.95) -> float:
    """The epsilon lower bound at ``confidence``: the largest eps such that every
    (eps', delta) with eps' <= eps is rejected at level alpha = 1 - confidence (0 when even
    eps = 0 is not rejected).

    Why this is a valid lower bound: if the training is (eps*, delta)-DP, reporting a bound
    above eps* means the test rejected the true hypothesis eps*, which happens with
    probability at most alpha. The search walks up from 0 and stops at the first eps the test
    no longer rejects, so it needs no monotonicity of the p-value in eps beyond the
    ``_SCAN_STEP`` grid (the binomial tail rises with eps; the delta term is small there).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    _check(canaries, guesses, correct, delta)
    alpha = 1.0 - confidence

    def excess(epsilon: float) -> float:
        return p_value(canaries, guesses, correct, epsilon, delta) - alpha

    if excess(0.0) > 0:
        return 0.0
    low = 0.0
    while low < _SCAN_LIMIT:
        high = low + _SCAN_STEP
        if excess(high) > 0:
            return float(optimize.brentq(excess, low, high, xtol=1e-6))
        low = high
    return _SCAN_LIMIT
