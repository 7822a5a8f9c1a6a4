"""How much DP noise an aggregated update carries (paper 002 Eq. 7, Eq. 8, Table 3).

Per coordinate, a silo's update after one round of DP-SGD carries Gaussian noise of variance
sigma_i^2 = steps * (lr * z * c / b)^2: each step adds N(0, z^2 c^2) to the sum of clipped
per-sample gradients, divides it by the expected batch b and scales it by the learning rate.
Averaging with weights w gives variance sum_i w_i^2 sigma_i^2, smallest for w_i ~ 1 / sigma_i^2.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def dp_noise_variance(
    noise_multiplier: float, clip_norm: float, learning_rate: float, batch_size: float,
    steps: float,
) -> float:
    """Per-coordinate variance of the DP noise summed over one round's ``steps`` steps:
    steps * (lr * z * c / b)^2 (paper 002 Eq. 7; units of the update squared)."""
    if batch_size <= 0 or steps < 0:
        raise ValueError(f"batch size must be positive and steps non-negative, "
                         f"got b={batch_size}, steps={steps}")
    return float(steps * (learning_rate * noise_multiplier * clip_norm / batch_size) ** 2)


def aggregated_noise_level(weights: Sequence[float] | np.ndarray,
                           variances: Sequence[float] | np.ndarray) -> float:
    """sum_i w_i^2 sigma_i^2: per-coordinate DP-noise variance of the weighted average of
    independent noisy updates (the paper's Table 3 quantity when lr = 1)."""
    w = np.asarray(weights, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    if w.shape != v.shape:
        raise ValueError(f"{w.size} weights for {v.size} variances")
    return float(np.sum(w**2 * v))


def inverse_variance_weights(variances: Sequence[float] | np.ndarray) -> np.ndarray:
    """w_i = (1 / sigma_i^2) / sum_j (1 / sigma_j^2) (paper 002 Eq. 8); silos with zero
    variance, if any, share all the weight equally (the limit of the formula)."""
    v = np.asarray(variances, dtype=np.float64)
    if v.size == 0 or np.any(v < 0) or not np.all(np.isfinite(v)):
        raise ValueError(f"variances must be finite and non-negative, got {v.tolist()}")
    exact = v == 0
    if exact.any():
        return exact / exact.sum()
    inverse = 1.0 / v
    return inverse / inverse.sum()


def oracle_noise_level(variances: Sequence[float] | np.ndarray) -> float:
    """The least aggregated noise any weights can give: 1 / sum_i (1 / sigma_i^2)."""
    v = np.asarray(variances, dtype=np.float64)
    return aggregated_noise_level(inverse_variance_weights(v), v)
