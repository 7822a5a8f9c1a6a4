"""Private cluster selection with the exponential mechanism.

docs/algorithm.md#stage-3-private-cluster-selection (A10) and
docs/privacy.md#exponential-mechanism-selections (P4).

A client scores every cluster model by its train accuracy in percent; changing one record
moves an accuracy by at most 100/(N-1) points, the sensitivity. Sampling with probability
proportional to exp(eps * u / (2 * sensitivity)) is eps-DP and, by the bounded-range
analysis, (eps^2/8)-zCDP, i.e. RDP alpha * eps^2 / 8 at every order alpha.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import special

from .rdp import DEFAULT_ORDERS


def accuracy_sensitivity(num_samples: int) -> float:
    """Sensitivity of an accuracy in % over N records to one record: 100 / (N - 1)."""
    if num_samples < 2:
        raise ValueError(f"need at least 2 training samples, got {num_samples}")
    return 100.0 / (num_samples - 1)


def _scaled_utilities(utilities: Sequence[float], epsilon: float, sensitivity: float) -> np.ndarray:
    if epsilon <= 0 or sensitivity <= 0:
        raise ValueError(f"epsilon and sensitivity must be positive ({epsilon}, {sensitivity})")
    u = np.asarray(utilities, dtype=np.float64)
    if u.ndim != 1 or u.size == 0:
        raise ValueError("utilities must be a non-empty 1-D sequence")
    return epsilon * u / (2 * sensitivity)


def selection_probabilities(
    utilities: Sequence[float], epsilon: float, sensitivity: float
) -> np.ndarray:
    """Pr[m] of the exponential mechanism: a softmax of eps * u_m / (2 * sensitivity)."""
    return special.softmax(_scaled_utilities(utilities, epsilon, sensitivity))


def select_cluster(
    utilities: Sequence[float], epsilon: float, sensitivity: float,
    rng: np.random.Generator | None = None,
) -> int:
    """Draw one cluster index with the exponential mechanism, via the Gumbel-max trick.

    Without ``rng`` the draw uses fresh OS entropy: a seed the server could know would let it
    undo the randomisation, so seeded generators are for tests and simulations only.
    """
    scaled = _scaled_utilities(utilities, epsilon, sensitivity)
    generator = rng if rng is not None else np.random.default_rng()
    return int(np.argmax(scaled + generator.gumbel(size=scaled.shape)))


def selection_rdp(epsilon: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP curve of one eps-DP exponential-mechanism selection: alpha * eps^2 / 8."""
    return np.asarray(orders, dtype=np.float64) * epsilon**2 / 8
