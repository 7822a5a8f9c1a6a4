"""Rules whose weights come from what silos report (paper 002 Table 1; docs/aggregation.md).

uniform (1/n), samples (N_i, DP-FedAvg), min-eps (N_i; the silos all calibrate for the least
epsilon, which is their business, not the server's), weiavg (claimed epsilon_i, Liu et al.
2021) and oracle-variance (1 / true sigma_i^2, for evaluation: a real server never knows it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .facts import Combination, UpdateFacts
from .noise import inverse_variance_weights


def _normalised(values: np.ndarray, what: str, facts: Sequence[UpdateFacts]) -> np.ndarray:
    bad = {f.partition: float(v) for f, v in zip(facts, values, strict=True)
           if not (v > 0 and np.isfinite(v))}
    if bad:
        raise ValueError(f"{what} must be positive and finite; got (silo: value) {bad}")
    return values / values.sum()


def uniform_weights(facts: Sequence[UpdateFacts]) -> np.ndarray:
    """1/n each (the R-DPCFL paper's per-cluster mean)."""
    return np.full(len(facts), 1.0 / len(facts))


def sample_weights(facts: Sequence[UpdateFacts]) -> np.ndarray:
    """N_i / sum_j N_j (DP-FedAvg; also min-eps)."""
    counts = np.array([f.num_train for f in facts], dtype=np.float64)
    return _normalised(counts, "record counts N_i", facts)


def epsilon_weights(facts: Sequence[UpdateFacts]) -> np.ndarray:
    """eps_i / sum_j eps_j over the *claimed* budgets (WeiAvg)."""
    claims = np.array([f.claimed_epsilon for f in facts], dtype=np.float64)
    return _normalised(claims, "claimed epsilons", facts)


def oracle_weights(facts: Sequence[UpdateFacts]) -> np.ndarray:
    """(1 / sigma_i^2) normalised, from the facts' true noise variances (paper 002 Eq. 8)."""
    unknown = [f.partition for f in facts if f.noise_variance is None]
    if unknown:
        raise ValueError(f"oracle-variance needs every silo's true noise variance; silo(s) "
                         f"{unknown} have none (UpdateFacts.noise_variance is None)")
    return inverse_variance_weights([float(f.noise_variance or 0.0) for f in facts])


def uniform(updates: np.ndarray, facts: Sequence[UpdateFacts]) -> Combination:
    return Combination(uniform_weights(facts), updates)


def samples(updates: np.ndarray, facts: Sequence[UpdateFacts]) -> Combination:
    return Combination(sample_weights(facts), updates)


def weiavg(updates: np.ndarray, facts: Sequence[UpdateFacts]) -> Combination:
    return Combination(epsilon_weights(facts), updates)


def oracle_variance(updates: np.ndarray, facts: Sequence[UpdateFacts]) -> Combination:
    return Combination(oracle_weights(facts), updates)
