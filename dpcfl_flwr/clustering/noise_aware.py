"""Noise-aware clustering of round-1 updates whose DP noise differs from silo to silo.

docs/algorithm.md#noise-aware-clustering derives every step (A12-A16).

Silo i's round-1 update is its cluster's mean plus Gaussian noise of per-coordinate variance
v_i, and v_i differs between silos when their budgets do. Three steps use it:

1. a projection from the n x n Gram matrix whose diagonal, where each silo's own noise energy
   p v_i sits, is imputed from the rest: the authors' projection puts a very noisy update on
   an axis of its own (its noise is its largest direction), which is how the spherical GMM
   ends up separating silos by noise level;
2. a mixture whose point i in cluster m has covariance (sigma_m^2 + e_i) I, e_i being silo
   i's noise above the least noisy silo's: with every v_i equal it is the spherical GMM;
3. v_i itself from the silo's reported noise plan, from the update's own spread off the other
   silos' principal subspace, or the plan floored by that estimate over a tolerance, so that
   a silo reporting less noise than it adds cannot move other silos.

All of it is numpy on the server's DP outputs (post-processing; no privacy cost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import scipy.linalg
from scipy.special import logsumexp

from .gmm import GMMFit, UpdateClusterer, overlap, scale_points, separation_scores

NoiseSource = Literal["plan", "estimate", "larger"]

# Same block size as the authors' projection: n x block floats beyond the updates themselves.
_COLUMN_BLOCK = 1 << 18
# sklearn's default regularisation of a spherical variance, kept so the two fits agree.
REG_COVAR = 1e-6


def update_gram(updates: np.ndarray) -> tuple[np.ndarray, int]:
    """The (n, n) Gram matrix X X^T of the (n, p) updates and p', the number of trained
    coordinates (those some update moves: a frozen parameter gets no DP noise)."""
    n, p = updates.shape
    gram = np.zeros((n, n))
    trained = 0
    for start in range(0, p, _COLUMN_BLOCK):
        block = np.asarray(updates[:, start:start + _COLUMN_BLOCK], dtype=np.float64)
        gram += block @ block.T
        trained += int(np.count_nonzero(np.any(block != 0, axis=0)))
    return gram, trained


def residual_noise_variances(gram: np.ndarray, trained: int) -> np.ndarray:
    """v_hat_i: the energy of update i off the span of all *other* updates, per remaining
    coordinate, 1 / ((G^-1)_ii (p' - n + 1)) (A14). That span does not depend on silo i's
    noise, so v_hat_i estimates v_i plus the part of its mean the span misses: never less
    than v_i on average, whatever silo i reports. One n x n inverse for all silos."""
    n = len(gram)
    scale = max(float(np.trace(gram)) / n, 1e-300)
    values, vectors = np.linalg.eigh(gram / scale)
    inverse_diagonal = (vectors**2) @ (1.0 / np.clip(values, 1e-12 * values.max(), None))
    return np.asarray(scale / inverse_diagonal / max(trained - n + 1, 1))


def _signal_axes(signal: np.ndarray, variances: np.ndarray | None,
                 count: int) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients a (n, count) of the directions X^T a with the most signal per unit of
    noise, and that ratio: generalised eigenvectors of the centred ``signal`` Gram (the Gram
    matrix less the noise on its diagonal) and of diag(v_i); with no variances, the plain
    principal directions. Each column sums to 0, so no direction carries the common mean."""
    n = len(signal)
    centring = np.eye(n) - 1.0 / n
    if variances is None:
        values, vectors = np.linalg.eigh(centring @ signal @ centring)
        order = np.argsort(values)[::-1][:count]
        return np.asarray(centring @ vectors[:, order]), values[order]
    v = np.asarray(variances, dtype=np.float64)
    whiten = 1.0 / np.sqrt(np.maximum(v, max(v.max(), 1e-300) * 1e-12))
    values, vectors = np.linalg.eigh(whiten[:, None] * (centring @ signal @ centring)
                                     * whiten[None, :])
    order = np.argsort(values)[::-1][:count]
    return np.asarray(centring @ (whiten[:, None] * vectors[:, order])), values[order]


def signal_gram(gram: np.ndarray, rank: int, iterations: int = 20) -> np.ndarray:
    """The Gram matrix of the updates' means: off the diagonal x_i . x_j, whose noise has
    mean 0; on it, ||x_i||^2 carries silo i's noise energy p' v_i, so it is replaced by the
    rank-``rank`` fit of the rest, refitted until it settles, at most ``iterations`` times
    (diagonal deletion, as heteroscedastic PCA does). Nothing a silo reports enters, so no
    report can leave its noise in (A13)."""
    off_diagonal = gram - np.diag(np.diag(gram))
    n = len(gram)
    diagonal = np.zeros(n)
    # Only the top ``rank`` eigenpairs enter: at 1,000 silos asking LAPACK for those alone
    # is 3x cheaper than the full decomposition (bench/scaling.py, server part).
    top = [max(n - rank, 0), n - 1]
    for _ in range(iterations):
        values, vectors = scipy.linalg.eigh(off_diagonal + np.diag(diagonal),
                                            subset_by_index=top)
        fitted = np.einsum("ik,k,ik->i", vectors, np.clip(values, 0.0, None), vectors)
        settled = np.abs(fitted - diagonal).max() <= 1e-6 * max(np.abs(fitted).max(), 1e-300)
        diagonal = fitted
        if settled:
            break
    return np.asarray(off_diagonal + np.diag(diagonal))


def combine_noise(reported: Sequence[float | None] | None, estimated: np.ndarray,
                  source: NoiseSource, tolerance: float = 10.0) -> np.ndarray:
    """v_i from the plan, the estimate, or (``larger``) the larger of the plan and the
    estimate over ``tolerance`` (A15): the estimate overshoots for a silo whose cluster has
    few quiet members, so it is a floor, not a replacement; a silo reporting more than
    ``tolerance`` x too little noise gets at least v_hat_i / tolerance. A silo without a
    plan gets its estimate under ``larger``; ``plan`` needs every silo's."""
    if source == "estimate":
        return estimated.copy()
    plans = [None] * len(estimated) if reported is None else list(reported)
    if len(plans) != len(estimated):
        raise ValueError(f"{len(plans)} reported noise variances for {len(estimated)} updates")
    if source == "plan":
        missing = [i for i, v in enumerate(plans) if v is None]
        if missing:
            raise ValueError(f"noise-source 'plan' needs every silo's noise plan; updates "
                             f"{missing} came without one (use 'larger' or 'estimate')")
        return np.array(plans, dtype=np.float64)
    if source == "larger":
        if not tolerance >= 1:
            raise ValueError(f"the estimate's tolerance must be >= 1, got {tolerance}")
        return np.array([e if v is None else max(float(v), e / tolerance)
                         for v, e in zip(plans, estimated, strict=True)])
    raise ValueError(f"noise source must be 'plan', 'estimate' or 'larger', got {source!r}")


def debiased_projection(gram: np.ndarray, variances: np.ndarray,
                        n_components: int) -> np.ndarray:
    """Points y_i in R^d whose noise is, to first order, N(0, v_i I_d) (A13).

    Axes: W = X^T A C^(-1/2), the directions of most signal per unit of noise
    (:func:`_signal_axes` on :func:`signal_gram`), made orthonormal (C = A^T G A). Point i is
    W^T x_i with its own noise energy ||xi_i||^2, which W carries back through a_i, replaced
    by its signal part: y = C^(-1/2) A^T S, S the signal Gram. Left in, that term gives a
    very noisy update an axis of its own; taken out as p' v_i, it would trust v_i."""
    v = np.asarray(variances, dtype=np.float64)
    signal = signal_gram(gram, n_components + 1)  # the common mean and d directions
    axes, ratios = _signal_axes(signal, v, n_components)
    if not ratios[0] > 0:  # later axes may be noise alone: their points are still honest
        raise ValueError("no direction of the updates stands above their DP noise; nothing "
                         "to cluster")
    values, vectors = np.linalg.eigh(axes.T @ gram @ axes)
    inverse_root = vectors @ np.diag(1.0 / np.sqrt(np.clip(values, 1e-300, None))) @ vectors.T
    return np.asarray(signal @ axes @ inverse_root)


def _log_densities(points: np.ndarray, noise: np.ndarray, means: np.ndarray,
                   variances: np.ndarray) -> np.ndarray:
    """log N(x_i; mu_m, diag(s_m + e_ik)) for every point i and component m, (n, M)."""
    total = variances[None, :, None] + noise[:, None, :]  # (n, M, d)
    squared = (points[:, None, :] - means[None, :, :]) ** 2
    return np.asarray(-0.5 * np.sum(np.log(2 * math.pi * total) + squared / total, axis=2))


def _m_step_component(points: np.ndarray, noise: np.ndarray, resp: np.ndarray,
                      variance: float, reg_covar: float,
                      inner_steps: int) -> tuple[np.ndarray, float]:
    """mu_m and s_m maximising sum_i r_im log N(x_i; mu_m, diag(s_m + e_ik)) (A12): no closed
    form once the e_i differ, so alternate the weighted mean with the fixed point
    s = sum r w^2 ((x - mu)^2 - e) / sum r w^2, w = 1 / (s + e), a few times. With every
    e_ik = 0 the weights are constant and one pass is sklearn's spherical M-step."""
    mass = resp.sum() + 10 * np.finfo(float).eps  # sklearn's guard against empty components
    mean = (resp @ points) / mass
    for _ in range(inner_steps):
        weights = 1.0 / (variance + noise)
        mean = (resp @ (weights * points)) / (resp @ weights + 1e-300) * (
            resp.sum() / mass)
        squared = (points - mean) ** 2
        w2 = resp[:, None] * weights**2
        spread = float(np.sum(w2 * (squared - noise)) / (np.sum(w2) + 1e-300))
        updated = max(spread, 0.0) + reg_covar
        if abs(updated - variance) <= 1e-12 * max(updated, reg_covar):
            variance = updated
            break
        variance = updated
    return mean, variance


def _seed_weights(points: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """k-means++ weights 1 / (s_0 + mean_k e_ik), s_0 the squared median nearest-neighbour
    distance per axis: a point much noisier than the data's local spread is rarely a seed
    (it would start a component on an outlier); equal weights, today's seeds, when every
    e_ik is 0."""
    excess = noise.mean(axis=1)
    if not np.any(excess > 0):
        return np.ones(len(points))
    squared = np.sum((points[:, None, :] - points[None, :, :]) ** 2, axis=2)
    np.fill_diagonal(squared, np.inf)
    spread = float(np.median(squared.min(axis=1))) / points.shape[1]
    return np.asarray(1.0 / (max(spread, REG_COVAR) + excess))


def fit_noise_aware_gmm(
    points: np.ndarray, noise: np.ndarray, n_clusters: int, random_state: int = 0,
    tol: float = 1e-6, max_iter: int = 100, reg_covar: float = REG_COVAR,
    inner_steps: int = 20,
) -> GMMFit:
    """Mixture of N(mu_m, diag(s_m + e_ik)) fitted by EM; ``noise`` holds e_ik, each point's
    known excess noise variance per axis ((n,) or (n, d)). Same start as
    :func:`~.gmm.fit_spherical_gmm` (k-means++ seeds, uniform weights, sklearn's stopping
    rule on the mean log-likelihood); radii sqrt(s_m) give MSS and MPO (A16)."""
    x = np.asarray(points, dtype=np.float64)
    n, d = x.shape
    e = np.broadcast_to(np.asarray(noise, dtype=np.float64).reshape(n, -1), (n, d))
    if not 2 <= n_clusters <= n:
        raise ValueError(f"cannot fit {n_clusters} clusters to {n} points")
    if np.any(e < 0) or not np.all(np.isfinite(e)):
        raise ValueError("noise variances must be finite and non-negative")
    from sklearn.cluster import kmeans_plusplus  # only where a mixture is fitted (gmm.py)

    _, seeds = kmeans_plusplus(x, n_clusters, random_state=np.random.RandomState(random_state),
                               sample_weight=_seed_weights(x, e))
    resp = np.zeros((n, n_clusters))
    resp[seeds, np.arange(n_clusters)] = 1.0
    variances = np.zeros(n_clusters)
    means = np.zeros((n_clusters, d))
    for m in range(n_clusters):  # one seed point each: spread 0, so s_m = reg_covar
        means[m], variances[m] = _m_step_component(x, e, resp[:, m], reg_covar, reg_covar,
                                                   1)
    log_weights = np.full(n_clusters, -math.log(n_clusters))
    bound, converged, n_iter = -np.inf, False, 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is reported
        joint = _log_densities(x, e, means, variances) + log_weights
        norm = logsumexp(joint, axis=1)
        resp = np.exp(joint - norm[:, None])
        for m in range(n_clusters):
            means[m], variances[m] = _m_step_component(x, e, resp[:, m], variances[m],
                                                       reg_covar, inner_steps)
        mass = resp.sum(axis=0) + 10 * np.finfo(float).eps
        log_weights = np.log(mass / mass.sum())
        previous, bound = bound, float(norm.mean())
        if abs(bound - previous) < tol:
            converged = True
            break
    # The authors' soft assignment: uniform weights, whatever EM estimated.
    joint = _log_densities(x, e, means, variances)
    responsibilities = np.exp(joint - logsumexp(joint, axis=1)[:, None])
    radii = component_radii(variances, responsibilities, e)
    mss = float(separation_scores(means, radii).min())
    return GMMFit(means, radii, responsibilities, n_iter, converged, mss, overlap(mss),
                  variances)


def component_radii(variances: np.ndarray, responsibilities: np.ndarray,
                    noise: np.ndarray) -> np.ndarray:
    """r_m = sqrt(s_m + the mean excess noise of its members, weighted by pi_im) (A16): the
    spread of component m as its own members see it; sqrt(s_m), today's radius, when every
    e_ik is 0. A component of very noisy silos is wide, however tight its fitted s_m."""
    mass = responsibilities.sum(axis=0) + 10 * np.finfo(float).eps
    member_noise = responsibilities.T @ noise.mean(axis=1) / mass
    return np.asarray(np.sqrt(variances + member_noise))


def scale_isotropically(points: np.ndarray, scaler: str = "minmax") -> tuple[np.ndarray, float]:
    """Shift each axis like :func:`~.gmm.scale_points` but divide every axis by the first
    (largest) axis' span or std, returned too: one factor keeps each point's noise
    isotropic, where a factor per axis would stretch the weak axes, mostly noise, to the
    size of the strong ones (A13)."""
    scaled = scale_points(points[:, :1], scaler)
    factor = float(points[:, 0].max() - points[:, 0].min()) if scaler == "minmax" else float(
        points[:, 0].std())
    factor = factor if factor > 0 else 1.0
    shift = points.min(axis=0) if scaler == "minmax" else points.mean(axis=0)
    del scaled
    return (points - shift) / factor, factor


class NoiseAwareClusterer(UpdateClusterer):
    """:class:`~.gmm.UpdateClusterer` for updates whose DP noise differs by silo
    (docs/algorithm.md#noise-aware-clustering): debiased projection, noise-aware mixture,
    and v_i from ``noise_source`` ("plan": the reported variances; "estimate": each update's
    spread off the span of the others' updates; "larger", the
    default: the plan, or the estimate over ``tolerance`` where that is larger, so that
    under-reporting changes nothing).

    ``fit(updates, reported)``: ``reported`` holds each silo's v_i from its noise plan, in
    the updates' units (None where a silo sent none). Besides the parent's attributes:
    ``noise_variances_`` (v_i used), ``estimated_noise_variances_`` (v_hat_i) and
    ``excess_noise_`` (e_ik, the points' noise above the least noisy silo's, scaled).
    """

    def __init__(
        self, n_clusters: int | None = None,
        candidate_clusters: Sequence[int] = tuple(range(2, 11)), scaler: str = "minmax",
        tol: float = 1e-6, max_iter: int = 100, random_state: int = 0,
        n_components: int | None = 2, noise_source: NoiseSource = "larger",
        tolerance: float = 10.0,
    ) -> None:
        super().__init__(n_clusters, candidate_clusters, scaler, tol, max_iter, random_state,
                         n_components)
        self.noise_source = noise_source
        self.tolerance = tolerance

    def fit(self, updates: np.ndarray,  # type: ignore[override]
            reported: Sequence[float | None] | None = None) -> NoiseAwareClusterer:
        """Fit on an (n clients, p parameters) matrix of round-1 updates."""
        n_points = updates.shape[0]
        candidates = self._candidates(n_points)
        dims = {m: self._dimension(m, n_points) for m in candidates}
        gram, trained = update_gram(updates)
        self.estimated_noise_variances_ = (np.zeros(n_points) if self.noise_source == "plan"
                                           else residual_noise_variances(gram, trained))
        self.noise_variances_ = combine_noise(reported, self.estimated_noise_variances_,
                                              self.noise_source, self.tolerance)
        self.projection_ = debiased_projection(gram, self.noise_variances_, max(dims.values()))
        scaled, factor = scale_isotropically(self.projection_, self.scaler)
        excess = self.noise_variances_ - self.noise_variances_.min()
        self.excess_noise_ = np.repeat(excess[:, None] / factor**2, scaled.shape[1], axis=1)
        fits = {m: fit_noise_aware_gmm(scaled[:, :dims[m]], self.excess_noise_[:, :dims[m]],
                                       m, self.random_state, self.tol, self.max_iter)
                for m in candidates}
        self._keep(fits, scaled[:, :dims[max(fits, key=lambda m: (fits[m].mss, -m))]])
        return self
