"""Robust-HDP: weight each silo by the inverse of its noise variance as read off the updates
(paper 002 §3.4, Alg. 1; docs/aggregation.md#robust-hdp).

The noise-free updates of silos with similar data are nearly low-rank, the DP noise in them is
not, so robust PCA of the p' x n matrix of updates (one column per silo) puts each silo's
noise in the sparse part S. sigma_hat_i^2 = ||S[:, i]||^2 / p' estimates silo i's
per-coordinate noise variance up to a factor common to all silos, which is all the
inverse-variance weights need (§3.5). Nothing a silo reports enters, so a silo that
overstates its epsilon gains no weight (§3.3).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from .fact_rules import sample_weights
from .facts import Combination, RuleSettings, UpdateFacts
from .noise import inverse_variance_weights
from .rpca import principal_component_pursuit

log = logging.getLogger(__name__)

#: An RPCA call slower than this (seconds) says once how to make it cheaper.
SLOW_RPCA_SECONDS = 10.0
_said_slow = False
_said_cut = False


def estimate_noise_variances(updates: np.ndarray, settings: RuleSettings) -> np.ndarray:
    """sigma_hat_i^2 per silo: ||S[:, i]||^2 / rows for the RPCA of the first p' trained
    coordinates of the (n, p) ``updates`` (units: the update's, squared).

    A coordinate that is exactly 0 in every update is a frozen parameter's (run config
    ``trainable``): DP-SGD adds no noise there, and a trained coordinate carrying Gaussian
    noise is never exactly 0. Such coordinates are left out, so the p' rows are trained ones
    (a frozen base ahead of the head would otherwise fill them with zeros)."""
    trained = np.flatnonzero(np.any(updates != 0, axis=0))
    if len(trained) == 0:  # no silo moved any coordinate: nothing to estimate from
        return np.zeros(updates.shape[0])
    rows = rpca_rows(len(updates), len(trained), settings)
    tol = rpca_tolerance(len(updates), len(trained), settings)
    variances = np.empty(len(updates))
    for group in rpca_groups(len(updates), len(trained), settings):
        block = updates[np.ix_(group, trained[:rows])].T
        start = time.perf_counter()
        result = principal_component_pursuit(block, tol=tol, max_iter=settings.rpca_max_iter)
        _say_if_slow(time.perf_counter() - start, block.shape)
        if not result.converged:
            log.warning("RPCA stopped after %d iterations at relative residual %.2e (tol "
                        "%.1e); using its current split", result.iterations, result.residual,
                        tol)
        variances[group] = np.sum(result.sparse**2, axis=0) / rows
    return variances


def rpca_rows(silos: int, trained: int, settings: RuleSettings) -> int:
    """p', the rows RPCA sees for a cluster of ``silos`` updates with ``trained`` trained
    coordinates: the smaller of those and ``rpca_rows``, cut to ``rpca_auto_rows`` when
    p' n^2 would pass ``rpca_work_limit``.

    Why: one PCP iteration costs about p' n^2 multiply-adds (its Gram matrix and the
    low-rank product), so at hundreds of silos per cluster the exact split of the whole CNN
    update took 13-18 CPU seconds per cluster, every round. Each silo's estimate
    ||S_i||^2 / p' has a relative error of about sqrt(2 / p') whatever n is, so a cluster
    that large loses little by using fewer rows: the paper's own device for large models
    (002 §3.6), applied only where the exact path is slow."""
    rows = min(trained, settings.rpca_rows)
    if _past_work_limit(silos, trained, settings):
        global _said_cut
        if not _said_cut:
            _said_cut = True
            log.info("robust-hdp: %d silos in a cluster, so RPCA uses the first %d "
                     "coordinates instead of %d and stops at relative residual %.0e "
                     "(rpca_work_limit = %.0e)", silos, min(rows, settings.rpca_auto_rows),
                     rows, settings.rpca_auto_tol, settings.rpca_work_limit)
        return min(rows, settings.rpca_auto_rows)
    return rows


def rpca_tolerance(silos: int, trained: int, settings: RuleSettings) -> float:
    """The relative residual RPCA stops at: ``rpca_tol``, or ``rpca_auto_tol`` for a cluster
    past the work limit, where the iterations after it move no weight by more than 0.04%
    (1,000 silos, p' = 1,000; a third of the iterations, bench/RESULTS.md, "Scaling: the
    server's work per round") against the 20-23% that cutting p' moves one."""
    return settings.rpca_auto_tol if _past_work_limit(silos, trained, settings) else (
        settings.rpca_tol)


def rpca_groups(silos: int, trained: int, settings: RuleSettings) -> list[np.ndarray]:
    """The silos (indices into the cluster's updates) of each RPCA: all of them, or, for a
    cluster past the work limit with more than ``rpca_auto_group`` silos, near-equal groups
    of at most that many drawn by a permutation seeded with ``seed``, each decomposed on its
    own (docs/aggregation.md#cost-at-many-silos).

    Why it holds: the low-rank part of a subset of the matrix's columns is those columns of
    the low-rank part, and each silo's sparse part is its own column's, so every group
    estimates the same thing from fewer columns (the column split of Mackey, Talwalkar and
    Jordan's divide-and-conquer matrix factorisation, 2011, without its recombination, as
    only the sparse part is used). An iteration costs p' n^2 for the Gram matrix and n^3 for
    its eigenpairs, so n / g groups of g silos cost together about g / n of the undivided
    iteration: the noise-aware clustering's two clusters of 432 and 576 silos of a
    1,008-silo run took 3.4 s of wall time a round undivided, 1.4 s in groups of 100."""
    if not (_past_work_limit(silos, trained, settings) and silos > settings.rpca_auto_group):
        return [np.arange(silos)]
    order = np.random.default_rng(settings.seed).permutation(silos)
    count = -(-silos // settings.rpca_auto_group)  # ceiling
    return [np.sort(part) for part in np.array_split(order, count)]


def _past_work_limit(silos: int, trained: int, settings: RuleSettings) -> bool:
    limit = settings.rpca_work_limit
    return limit is not None and min(trained, settings.rpca_rows) * silos**2 > limit


def _say_if_slow(seconds: float, shape: tuple[int, ...]) -> None:
    """Once per process: an RPCA this slow (hundreds of silos in one cluster) has a cheaper
    setting whose weights the scaling bench found as good: fewer rows p'."""
    global _said_slow
    if seconds < SLOW_RPCA_SECONDS or _said_slow:
        return
    _said_slow = True
    log.warning("robust-hdp: RPCA of a %d x %d matrix took %.0f s; its cost grows with p' "
                "(rpca-rows) times the silos squared, and rpca-rows = 2000-8000 cuts it "
                "several-fold at hundreds of silos (docs/aggregation.md#cost-at-many-silos)",
                shape[0], shape[1], seconds)


def robust_hdp(
    updates: np.ndarray, facts: Sequence[UpdateFacts], settings: RuleSettings,
) -> Combination:
    """Inverse estimated-variance weights, or "samples" weights (with ``fallback`` saying
    why) when the cluster has fewer than ``rpca_min_silos`` updates or some silo's estimate
    is zero.

    A zero estimate means RPCA explained that silo's update entirely by the low-rank part (an
    all-zero update, a copy of others, or a silo adding no noise). Its inverse would be
    infinite and hand it all the weight; for an update that carries no information that is
    the worst answer, so the rule does not trust this round's estimates at all.
    """
    if len(facts) < settings.rpca_min_silos:
        return Combination(sample_weights(facts), updates, None,
                           f"robust-hdp: {len(facts)} update(s) < rpca_min_silos="
                           f"{settings.rpca_min_silos}; samples weights")
    variances = estimate_noise_variances(updates, settings)
    silent = [f.partition for f, v in zip(facts, variances, strict=True) if not v > 0]
    if silent:
        return Combination(sample_weights(facts), updates, variances,
                           f"robust-hdp: zero estimated noise for silo(s) {silent} (update "
                           "fully low-rank); samples weights")
    return Combination(inverse_variance_weights(variances), updates, variances, None)
