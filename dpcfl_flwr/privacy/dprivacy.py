"""The Euclidean Laplace mechanism on a released model vector (d-privacy, paper 004 §3).

What it protects. A silo adds noise to the model it sends so that two parameter vectors
``x1, x2`` in R^n yield releases whose probabilities differ by at most a factor
``exp(epsilon * ||x1 - x2||_2)`` (paper 004 Eq. 5, Prop. 3.1). The protected object is the
model vector, and only within a radius: models a short distance apart are hard to tell apart,
models far apart are not. No record of the silo's data is protected as such, so this is not
(eps, delta)-DP over records, and the two guarantees have no common unit.

How it is calibrated. The paper's SanitizeUpdate (Alg. 2) sets ``epsilon = n / (v ||delta||)``
from the update ``delta = trained - received`` and a noise multiplier ``v``: the expected noise
norm is then ``v ||delta||`` and points within ``||delta||`` of each other are ``n / v``
indistinguishable per release (the ``leakage``). Three limits follow, and users should know
them before choosing it:

- epsilon depends on the private update itself. Prop. 3.1 assumes a fixed epsilon, so the
  calibrated mechanism as a whole is not strictly covered by it (paper 004 proves nothing more).
- The release reveals the update's norm almost exactly: for large n the noise norm
  concentrates at ``v ||delta||`` and is nearly orthogonal to ``delta``, so
  ``||released - received||^2 ≈ ||delta||^2 (1 + v^2)``.
- The per-release leakage n / v grows with the model: for the paper-sized CNN here
  (n ≈ 29k) it is thousands per round, a vacuous formal bound. What remains is an empirical
  defence (noise of v times the update's norm), e.g. against gradient inversion.

docs/dprivacy.md says the same for users; the ledger keeps these leakages apart from the
(eps, delta)-DP spend (``DPrivacyRelease`` in ledger.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The direction is drawn in pieces so that a model of tens of millions of parameters needs no
# second full-size float64 buffer for the squared norm.
_CHUNK = 1 << 20


def euclidean_laplace(n: int, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """Noise in R^n with density proportional to ``exp(-epsilon ||x||_2)`` (paper 004 §3.1).

    The norm is Gamma(shape n, scale 1/epsilon) (Eq. 12) and the direction uniform on the
    unit sphere (a normalised standard Gaussian vector). Each coordinate then has mean 0 and
    variance (n + 1) / epsilon^2. ``epsilon = inf`` gives zeros. float64.
    """
    if n < 1:
        raise ValueError(f"euclidean_laplace needs a dimension n >= 1, got {n}")
    if not epsilon > 0:
        raise ValueError(f"euclidean_laplace needs epsilon > 0 (inf allowed), got {epsilon}")
    if math.isinf(epsilon):
        return np.zeros(n)
    radius = rng.gamma(shape=n, scale=1.0 / epsilon)
    direction = np.empty(n)
    squared = 0.0
    for start in range(0, n, _CHUNK):
        piece = rng.standard_normal(min(_CHUNK, n - start))
        direction[start:start + piece.size] = piece
        squared += float(piece @ piece)
    direction *= radius / math.sqrt(squared)
    return direction


def euclidean_laplace_log_density(x: np.ndarray, center: np.ndarray, epsilon: float) -> float:
    """``log L_{center, epsilon}(x)``, the mechanism's log density at ``x`` (paper 004 §3.1):
    ``log K - epsilon ||x - center||`` with ``K = epsilon^n Γ(n/2) / (2 π^(n/2) Γ(n))``."""
    n = int(np.asarray(center).size)
    log_k = (n * math.log(epsilon) + math.lgamma(n / 2) - math.log(2)
             - (n / 2) * math.log(math.pi) - math.lgamma(n))
    distance = float(np.linalg.norm(np.asarray(x, float) - np.asarray(center, float)))
    return log_k - epsilon * distance


@dataclass(frozen=True)
class Sanitized:
    """One release of SanitizeUpdate.

    ``released`` is the noised model; ``epsilon`` is per unit of Euclidean distance (``inf``
    when the update was zero and nothing was added); ``leakage = epsilon ||delta|| = n / v``,
    the indistinguishability of points within the update's norm, for this one release.
    """

    released: np.ndarray
    epsilon: float
    leakage: float


def sanitize_update(trained: np.ndarray, received: np.ndarray, noise_multiplier: float,
                    rng: np.random.Generator) -> Sanitized:
    """The paper's SanitizeUpdate (paper 004 Alg. 2): release ``trained`` plus Euclidean
    Laplace noise of epsilon ``n / (v ||trained - received||)``, v = ``noise_multiplier``.

    ``v`` must be > 0: v = 0 means no privatiser at all, a choice the caller makes (and
    records) rather than this function. A zero update gets no noise and epsilon ``inf``; its
    leakage is still reported as n / v, the paper's per-participation figure.
    """
    if not noise_multiplier > 0 or math.isinf(noise_multiplier):
        raise ValueError(
            f"sanitize_update needs a finite noise multiplier v > 0, got {noise_multiplier}; "
            "v = 0 means no sanitisation, which the caller must handle by not calling it")
    trained = np.asarray(trained, dtype=np.float64).ravel()
    received = np.asarray(received, dtype=np.float64).ravel()
    if trained.shape != received.shape:
        raise ValueError(f"sanitize_update: trained has {trained.size} parameters but the "
                         f"received model has {received.size}")
    n = trained.size
    leakage = n / noise_multiplier
    norm = float(np.linalg.norm(trained - received))
    if norm == 0.0:
        return Sanitized(released=trained.copy(), epsilon=math.inf, leakage=leakage)
    epsilon = n / (noise_multiplier * norm)
    return Sanitized(released=trained + euclidean_laplace(n, epsilon, rng), epsilon=epsilon,
                     leakage=leakage)
