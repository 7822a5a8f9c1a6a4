"""Renyi-DP arithmetic: the Poisson-subsampled Gaussian mechanism and RDP -> (eps, delta).

The sampled Gaussian mechanism (SGM) bound is the one of Mironov, Talwar & Zhang (2019),
"Renyi Differential Privacy of the Sampled Gaussian Mechanism", Sections 3.2 (integer orders,
a finite binomial sum) and 3.3 (fractional orders, two infinite series with erfc factors).
It is the add/remove-adjacency bound; docs/privacy.md#adjacency says why we keep it.

Everything here is a pure function of floats so that tests can compare it against an
independent implementation (Opacus' RDP analysis) and against the authors' reference tables.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from .defaults import DEFAULT_CONVERSION, Conversion

#: RDP orders alpha used throughout: 1.1, 1.2, ..., 10.9 then the integers 12..63 (the
#: TF-Privacy/authors' grid, which is also Opacus' default; docs/privacy.md#rdp-orders).
DEFAULT_ORDERS: tuple[float, ...] = tuple(1 + x / 10 for x in range(1, 100)) + tuple(
    float(a) for a in range(12, 64)
)

# Series terms below exp(-30) are dropped: A_alpha >= 1, so this is a relative error < 1e-13.
_LOG_TERM_FLOOR = -30.0
_TERM_BLOCK = 64
_MAX_TERMS = 100_000


def _log_binomial_abs_and_sign(alpha: float, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log|C(alpha, k)| and its sign, valid for real alpha and integer k >= 0."""
    coef = special.binom(alpha, k)
    with np.errstate(divide="ignore"):
        return np.log(np.abs(coef)), np.sign(coef)


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for an integer order: a finite sum of positive terms."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_terms = (
        special.gammaln(alpha + 1)
        - special.gammaln(k + 1)
        - special.gammaln(alpha - k + 1)
        + k * math.log(q)
        + (alpha - k) * math.log1p(-q)
        + (k * k - k) / (2 * sigma**2)
    )
    return float(special.logsumexp(log_terms))


def _log_half_erfc(x: np.ndarray) -> np.ndarray:
    """log(erfc(x) / 2), accurate far into the tail (erfc(x)/2 = Phi(-x * sqrt 2))."""
    return special.log_ndtr(-x * math.sqrt(2.0))


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha for a fractional order, summing both series until the terms vanish."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    log_parts: list[np.ndarray] = []
    sign_parts: list[np.ndarray] = []
    start = 0
    while True:
        i = np.arange(start, start + _TERM_BLOCK, dtype=np.float64)
        j = alpha - i
        log_binom, sign = _log_binomial_abs_and_sign(alpha, i)
        first = (
            log_binom + i * log_q + j * log_1mq + (i * i - i) / (2 * sigma**2)
            + _log_half_erfc((i - z0) / (math.sqrt(2) * sigma))
        )
        second = (
            log_binom + j * log_q + i * log_1mq + (j * j - j) / (2 * sigma**2)
            + _log_half_erfc((z0 - j) / (math.sqrt(2) * sigma))
        )
        log_parts += [first, second]
        sign_parts += [sign, sign]
        start += _TERM_BLOCK
        past_peak = start > alpha + 1
        # For i > alpha the terms alternate in sign, so stopping errs by at most the next term.
        if past_peak and (max(first[-1], second[-1]) < _LOG_TERM_FLOOR or start >= _MAX_TERMS):
            break
    logs, signs = np.concatenate(log_parts), np.concatenate(sign_parts)
    value, value_sign = special.logsumexp(logs, b=signs, return_sign=True)
    if value_sign <= 0:  # pragma: no cover - would mean a numerically broken series
        raise ArithmeticError(f"SGM series lost precision at alpha={alpha}, q={q}, sigma={sigma}")
    return float(value)


def sgm_rdp_single(sample_rate: float, noise_multiplier: float, order: float) -> float:
    """RDP at one order of one step of the Poisson-sampled Gaussian mechanism.

    ``sample_rate`` is q (1.0 = the full batch, no amplification: exactly alpha / (2 z^2));
    ``noise_multiplier`` is z, the noise std divided by the clipping norm.
    """
    if not 0.0 <= sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in [0, 1], got {sample_rate}")
    if order <= 1.0:
        raise ValueError(f"RDP orders must exceed 1, got {order}")
    if sample_rate == 0.0:
        return 0.0
    if noise_multiplier <= 0.0:
        return math.inf
    if sample_rate == 1.0:
        return order / (2 * noise_multiplier**2)
    if float(order).is_integer():
        log_a = _log_a_integer(sample_rate, noise_multiplier, int(order))
    else:
        log_a = _log_a_fractional(sample_rate, noise_multiplier, order)
    return log_a / (order - 1)


def sgm_rdp(
    sample_rate: float, noise_multiplier: float, steps: float,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> np.ndarray:
    """RDP curve of ``steps`` compositions of the SGM (steps may be fractional for planning)."""
    return _per_step_curve(float(sample_rate), float(noise_multiplier),
                           tuple(float(a) for a in orders)) * steps


@functools.lru_cache(maxsize=256)
def _per_step_curve(sample_rate: float, noise_multiplier: float,
                    orders: tuple[float, ...]) -> np.ndarray:
    """One SGM step's RDP curve, remembered: a silo's ledger asks for the same (q, z) curve
    several times per message (the check before a round, the epsilon it reports), and the
    fractional orders' series cost ~20 ms of Python per curve. Read-only, so a caller cannot
    change what later callers get."""
    curve = np.array([sgm_rdp_single(sample_rate, noise_multiplier, a) for a in orders])
    curve.flags.writeable = False
    return curve


def rdp_to_dp(
    rdp: np.ndarray, delta: float, conversion: Conversion = DEFAULT_CONVERSION,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> tuple[float, float]:
    """Convert an RDP curve to (eps, delta)-DP; returns (epsilon, best order).

    ``classic`` is Mironov (2017), Prop. 3: eps = RDP(a) + ln(1/delta)/(a-1), what the authors
    used. ``tight`` is Balle et al. (2020), Thm. 21 (Opacus' conversion):
    eps = RDP(a) + ln((a-1)/a) - (ln delta + ln a)/(a-1). Both are valid upper bounds.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    a = np.asarray(orders, dtype=np.float64)
    curve = np.asarray(rdp, dtype=np.float64)
    if curve.shape != a.shape:
        raise ValueError(f"RDP curve has {curve.shape} values for {a.shape} orders")
    if conversion == "classic":
        eps = curve + math.log(1 / delta) / (a - 1)
    elif conversion == "tight":
        eps = curve + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    else:
        raise ValueError(f"conversion must be 'classic' or 'tight', got {conversion!r}")
    if np.all(np.isnan(eps)):
        return math.inf, math.nan
    best = int(np.nanargmin(eps))
    return float(max(eps[best], 0.0)), float(a[best])
