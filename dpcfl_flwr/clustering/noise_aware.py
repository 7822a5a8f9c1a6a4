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
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import scipy.linalg
from scipy.spatial.distance import cdist

from ..blas_threads import one_blas_thread, outer_blas_threads
from .blocks import UpdateMatrix, column_blocks
from .eigen import top_eigenpairs
from .gmm import GMMFit, UpdateClusterer, overlap, scale_points, separation_scores

NoiseSource = Literal["plan", "estimate", "larger"]

# sklearn's default regularisation of a spherical variance, kept so the two fits agree.
REG_COVAR = 1e-6

#: Lanczos' relative accuracy in the signal Gram's refits, which stop once the diagonal moves
#: by less than 1e-6: at 1,008 silos 0.11 s of refits instead of 0.18 s at machine precision,
#: the diagonal within 1.3e-11 of that.
REFIT_TOLERANCE = 1e-10


def update_gram(updates: UpdateMatrix) -> tuple[np.ndarray, int]:
    """The (n, n) Gram matrix X X^T of the (n, p) updates and p', the number of trained
    coordinates (those some update moves: a frozen parameter gets no DP noise).

    Each column block's product is computed in float32, the precision the silos send, and
    summed in float64: twice as fast (at 1,008 silos of the CNN 0.28 s against 0.66 s on
    two BLAS threads) and harmless: where DP noise dominates the updates, every entry
    already carries noise of about ||x_i|| ||x_j|| / sqrt(p'), while float32 rounding over
    a block of w columns is about sqrt(w) 2^-24 of it (w from :func:`.blocks.column_width`:
    2,080 at 1,008 silos, 99,864 at 21). For the CNN (p' = 28,938) the noise is 2,000 times
    the rounding at 1,008 silos and 300 times at 21; for ResNet-18 (11 million) 110 and 16
    times. Measured at 1,008 silos: the Gram within 1.4e-7 of ||x_i|| ||x_j||, the noise
    estimates within 5e-7 of the float64 ones, identical responsibilities. A block whose
    float32 product overflows (an update with values past ~1e17, which a silo may send) is
    multiplied again in float64, where no float32 value's square overflows."""
    n = updates.shape[0]
    gram = np.zeros((n, n))
    trained = 0
    for block in column_blocks(updates, np.float32):
        # n^2 p multiply-adds: the one step more threads speed up
        with outer_blas_threads(), np.errstate(over="ignore"):
            product = block @ block.T
            if not np.isfinite(product).all():  # values whose squares pass float32's range
                wide = block.astype(np.float64)  # (a silo may send any finite float32)
                product = wide @ wide.T
        gram += product
        trained += int(np.count_nonzero(np.any(block != 0, axis=0)))
    return gram, trained


#: The largest ratio of one update's norm to the median update's that the fit takes: its Gram
#: matrix then spans 12 of float64's ~16 significant digits; at ~1e9 the fit overflowed. A run
#: drops updates far sooner (1,000x, ``strategies.replies.far_off_updates``).
MAX_NORM_SPREAD = 1e6


def check_norm_spread(gram: np.ndarray) -> None:
    """ValueError naming the update whose norm (from the Gram's diagonal) is more than
    :data:`MAX_NORM_SPREAD` times the median update's: beside it, the fit cannot resolve the
    others."""
    norms = np.sqrt(np.clip(np.diagonal(gram), 0.0, None))
    median = float(np.median(norms))
    worst = int(np.argmax(norms))
    if median > 0 and norms[worst] > MAX_NORM_SPREAD * median:
        raise ValueError(f"update {worst}'s norm is {norms[worst] / median:.3g} times the "
                         f"median update's (at most {MAX_NORM_SPREAD:g}): the others cannot "
                         "be told apart beside it; drop it before clustering")


def residual_noise_variances(gram: np.ndarray, trained: int) -> np.ndarray:
    """v_hat_i: the energy of update i off the span of all *other* updates, per remaining
    coordinate, 1 / ((G^-1)_ii (p' - n + 1)) (A14). That span does not depend on silo i's
    noise, so v_hat_i estimates v_i plus the part of its mean the span misses: never less
    than v_i on average, whatever silo i reports. One n x n inverse for all silos."""
    n = len(gram)
    scale = max(float(np.trace(gram)) / n, 1e-300)
    inverse_diagonal = _inverse_diagonal(gram / scale)
    return np.asarray(scale / inverse_diagonal / max(trained - n + 1, 1))


def _inverse_diagonal(matrix: np.ndarray) -> np.ndarray:
    """diag(A^-1) of a symmetric positive semi-definite A, its eigenvalues floored at 1e-12
    of the largest (more updates than trained coordinates leave A singular).

    From a Cholesky factor when A is well conditioned (estimated reciprocal condition number
    above 1e-8, so no eigenvalue is near the floor): at 1,000 silos 0.05 s against 0.3 s
    for the full eigendecomposition, which remains the path for a (nearly) singular A."""
    lapack = scipy.linalg.lapack
    factor, info = lapack.dpotrf(matrix)
    if info == 0:
        norm = float(np.abs(matrix).sum(axis=0).max())  # the 1-norm dpocon's estimate needs
        rcond, info = lapack.dpocon(factor, norm)
        if info == 0 and rcond > 1e-8:
            inverse, info = lapack.dpotri(factor)
            if info == 0:
                return np.asarray(np.diag(inverse).copy())
    values, vectors = np.linalg.eigh(matrix)
    return np.asarray((vectors**2) @ (1.0 / np.clip(values, 1e-12 * values.max(), None)))


def _centred(matrix: np.ndarray) -> np.ndarray:
    """C S C for the centring C = I - 11^T / n and a symmetric S, by subtracting row,
    column and grand means: the two n x n products took 0.12 s at 1,000 silos."""
    row = matrix.mean(axis=1)
    return np.asarray(matrix - row[:, None] - matrix.mean(axis=0)[None, :] + row.mean())


def _signal_axes(signal: np.ndarray, variances: np.ndarray | None,
                 count: int) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients a (n, count) of the directions X^T a with the most signal per unit of
    noise, and that ratio: generalised eigenvectors of the centred ``signal`` Gram (the Gram
    matrix less the noise on its diagonal) and of diag(v_i); with no variances, the plain
    principal directions. Each column sums to 0, so no direction carries the common mean."""
    centred = _centred(signal)
    if variances is None:
        values, vectors = top_eigenpairs(centred, count)
        return np.asarray(vectors - vectors.mean(axis=0)), values
    v = np.asarray(variances, dtype=np.float64)
    whiten = 1.0 / np.sqrt(np.maximum(v, max(v.max(), 1e-300) * 1e-12))
    values, vectors = top_eigenpairs(whiten[:, None] * centred * whiten[None, :], count)
    axes = whiten[:, None] * vectors
    return np.asarray(axes - axes.mean(axis=0)), values


def signal_gram(gram: np.ndarray, rank: int, iterations: int = 20) -> np.ndarray:
    """The Gram matrix of the updates' means: off the diagonal x_i . x_j, whose noise has
    mean 0; on it, ||x_i||^2 carries silo i's noise energy p' v_i, so it is replaced by the
    rank-``rank`` fit of the rest, refitted until it settles, at most ``iterations`` times
    (diagonal deletion, as heteroscedastic PCA does). Nothing a silo reports enters, so no
    report can leave its noise in (A13)."""
    diagonal = np.zeros(len(gram))
    # Only the top ``rank`` eigenpairs enter (:func:`.eigen.top_eigenpairs`), and each iteration
    # changes only the diagonal of one n x n buffer (8 MB at 1,000 silos).
    matrix = np.array(gram, dtype=np.float64)
    start = None  # the last refit's eigenvectors, summed: Lanczos starts near their span
    for _ in range(iterations):
        np.fill_diagonal(matrix, diagonal)
        values, vectors = top_eigenpairs(matrix, rank, start, REFIT_TOLERANCE)
        start = vectors.sum(axis=1)
        fitted = np.einsum("ik,k,ik->i", vectors, np.clip(values, 0.0, None), vectors)
        settled = np.abs(fitted - diagonal).max() <= 1e-6 * max(np.abs(fitted).max(), 1e-300)
        diagonal = fitted
        if settled:
            break
    signal = np.array(gram, dtype=np.float64)
    np.fill_diagonal(signal, diagonal)
    return signal


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


def _log_sum_exp(joint: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """log sum_m exp(joint[i, m]) per row i and mixture c, over the columns m with
    ``owner[m]`` = c (each mixture's components side by side, ``owner`` ascending from 0):
    (C, n), each mixture's row contiguous so that its mean sums as a separate fit's does.
    Computed as scipy's ``logsumexp`` does (the largest terms apart, then log1p of the rest),
    without its per-call overhead: ~1.5 ms a call, which at 1,000 silos made a twentieth of
    the EM's time."""
    starts = _first_columns(owner)
    top = np.maximum.reduceat(joint, starts, axis=1)
    spread_top = top[:, owner]
    at_top = joint == spread_top
    ties = np.add.reduceat(at_top, starts, axis=1, dtype=np.intp).astype(np.float64)
    rest = np.add.reduceat(np.where(at_top, 0.0, _exp(joint - spread_top)), starts,
                           axis=1) / ties
    return np.ascontiguousarray((np.log1p(rest) + np.log(ties) + top).T)


def _exp(x: np.ndarray) -> np.ndarray:
    """exp(x), leaving 0 where x < -746, which is what exp gives there (it underflows below
    -745.14): most of a point's components are that far when clusters are well separated,
    and numpy's float64 exp costs ~13 ns a term on a CPU without AVX-512 (at 1,000 silos,
    0.6 ms for one (n, K) array of 45 components, 0.2 ms so)."""
    return np.exp(x, out=np.zeros_like(x), where=x > -746.0)


def _first_columns(owner: np.ndarray) -> np.ndarray:
    """Where each mixture's run of components starts in an ascending ``owner``."""
    return np.flatnonzero(np.diff(owner, prepend=-1))


def _log_densities(points: np.ndarray, noise: np.ndarray, means: np.ndarray,
                   variances: np.ndarray, axes: np.ndarray) -> np.ndarray:
    """log N(x_i; mu_m, diag(s_m + e_ik)) over the first ``axes[m]`` axes, for every point i
    and component m, (n, K); the means' other axes are 0.

    ``noise`` is (n, d), or (n, 1) when each point's e_i is the same on every axis (the
    clusterer's case): then a point's axes[m] equal terms are summed once, and its squared
    distance to each mean comes from ``cdist`` with no (n, K, d) array. With (n, d) noise
    every component has all d axes."""
    if noise.shape[1] == 1:
        total = variances[None, :] + noise  # (n, K)
        log_norm = np.log(2 * math.pi * total)
        log_norm *= axes
        log_norm += _squared_distances(points, means, axes) / total
        log_norm *= -0.5
        return log_norm
    per_axis = variances[None, :, None] + noise[:, None, :]  # (n, K, d)
    squared = (points[:, None, :] - means[None, :, :]) ** 2
    return np.asarray(-0.5 * (np.sum(np.log(2 * math.pi * per_axis), axis=2)
                              + np.sum(squared / per_axis, axis=2)))


def _squared_distances(points: np.ndarray, means: np.ndarray, axes: np.ndarray) -> np.ndarray:
    """||x_i - mu_m||^2 over the first ``axes[m]`` axes, (n, K): one ``cdist`` per number of
    axes, so each distance is the one a fit on those axes alone computes."""
    squared = np.empty((len(points), len(means)))
    for count in np.unique(axes):
        mine = axes == count
        squared[:, mine] = cdist(points[:, :count], means[mine, :count], "sqeuclidean")
    return squared


def _m_step(points: np.ndarray, noise: np.ndarray, resp: np.ndarray, variances: np.ndarray,
            reg_covar: float, inner_steps: int,
            axes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mu_m and s_m maximising sum_i r_im log N(x_i; mu_m, diag(s_m + e_ik)) (A12), for every
    component m at once: no closed form once the e_i differ, so alternate the weighted mean
    with the fixed point s = sum r w^2 ((x - mu)^2 - e) / sum r w^2, w = 1 / (s + e), at most
    ``inner_steps`` times, each component until its s_m settles (then it is left as it is).
    With every e_ik = 0 the weights are constant and one pass is sklearn's spherical M-step.
    ``noise`` is (n, d), or (n, 1) as in :func:`_log_densities`; component m lives on the
    first ``axes[m]`` axes of the points (fewer than d for a mixture fitted on fewer axes
    beside others, isotropic noise only). Returns means (K, d), 0 beyond each component's
    axes, and s (K,).

    Why it is written this way: at 1,000 silos a Python loop over the components, ~15 numpy
    calls on (n, d) arrays per fixed-point step, was most of the round-1 clustering's time
    (bench/scaling.py, server part). Here one step is one batched matrix product of the
    weights [r w, r w^2] with the columns of :class:`_Members` plus a few small operations,
    for all components at once, and the weighted squared distances are
    sum r w^2 ||x - c||^2 with c_m the plain weighted mean, computed once per M-step, less
    the exact correction for mu_m - c_m (c_m is the component's own centre: nothing
    cancels). Components reaching over twice the median number of points go in a batch of
    their own: padded to the widest, the others would multiply the work (at 1,000 silos a
    2-cluster fit's components reach all points, the 10-cluster fit's 286)."""
    reach = np.count_nonzero(resp, axis=0)
    wide = reach > 2 * np.median(reach)
    if wide.any():
        means, spreads = np.empty((len(reach), points.shape[1])), np.empty(len(reach))
        for part in (wide, ~wide):
            means[part], spreads[part] = _m_step(points, noise, resp[:, part], variances[part],
                                                 reg_covar, inner_steps, axes[part])
        return means, spreads
    weight = resp.T  # (K, n)
    total = weight.sum(axis=1)
    mass = total + 10 * np.finfo(float).eps  # sklearn's guard against empty components
    centres = (weight @ points) / mass[:, None]
    centres[np.arange(points.shape[1])[None, :] >= axes[:, None]] = 0.0
    members = _Members(points, noise, weight, centres, axes)
    q = members.per_column
    means, spreads = centres.copy(), np.array(variances, dtype=np.float64)
    active = np.arange(len(spreads))
    share, spread = (total / mass)[:, None, None], spreads.copy()  # of the active components
    for _ in range(inner_steps):
        sums = members.sums(spread)  # (k, a, 2, q + 2)
        mean = sums[:, :, 0, :q] / (sums[:, :, 0, q:q + 1] + 1e-300)
        mean += members.centres
        mean *= share
        shift = mean - members.centres
        w2 = sums[:, :, 1, q:q + 1]
        # sum r w^2 ||x - mu||^2 = sum r w^2 ||x - c||^2 + shift . (shift sum r w^2
        #                          - 2 sum r w^2 (x - c)), per noise column
        quadratic = np.einsum("kaq,kaq->k", shift, shift * w2 - 2 * sums[:, :, 1, :q])
        updated = ((sums[:, :, 1, q + 1].sum(axis=1) + quadratic)
                   / (members.counts * w2.sum(axis=(1, 2)) + 1e-300))
        np.maximum(updated, 0.0, out=updated)
        updated += reg_covar  # so updated >= reg_covar
        settled = np.abs(updated - spread) <= 1e-12 * updated
        spread = updated
        if settled.any():
            means[active], spreads[active] = mean.reshape(len(active), -1), spread
            keep = ~settled
            active, share, spread, mean = active[keep], share[keep], spread[keep], mean[keep]
            members.keep(keep)
            if not len(active):
                return means, spreads
    means[active], spreads[active] = mean.reshape(len(active), -1), spread
    return means, spreads


class _Members:
    """For the M-step's fixed point: per component m, the points with r_im > 0 (in their
    order, then points of r_im = 0 to fill the width; those add exact zeros), and per noise
    column a (one for isotropic noise, else one per axis, each over its q = d / a axes) the
    columns [x - c_m (q), 1, ||x - c_m||^2 - q_m e] that the weights multiply, q_m of the q
    axes being component m's own (the others' x - c_m are 0). With well-separated clusters
    most r_im underflow to 0, so a component's sums run over its own cluster only: 286 of
    1,000 points in the scaling bench."""

    def __init__(self, points: np.ndarray, noise: np.ndarray, weight: np.ndarray,
                 centres: np.ndarray, axes: np.ndarray) -> None:
        columns = noise.shape[1]
        q = self.per_column = points.shape[1] // columns
        self.counts = axes // columns  # q_m
        reached = np.ascontiguousarray(weight > 0)  # weight is resp.T: rows, not columns
        width = max(int(reached.sum(axis=1).max()), 1)
        index = np.argsort(~reached, axis=1, kind="stable")[:, :width]
        self.r = np.take_along_axis(weight, index, axis=1)[:, None, :]  # (K, 1, w)
        self.noise = np.ascontiguousarray(np.take(noise, index, axis=0).transpose(0, 2, 1))
        self.centres = centres.reshape(len(index), columns, q)
        self.values = np.empty((len(index), columns, width, q + 2))
        offsets = self.values[..., :q]
        own = _on_own_axes(points, axes, index)  # (K, w, d)
        np.subtract(own.reshape(len(index), width, columns, q), self.centres[:, None],
                    out=offsets.transpose(0, 2, 1, 3))
        self.values[..., q] = 1.0
        np.einsum("kawq,kawq->kaw", offsets, offsets, out=self.values[..., q + 1])
        self.values[..., q + 1] -= self.counts[:, None, None] * self.noise

    def sums(self, spreads: np.ndarray) -> np.ndarray:
        """[sum r w v, sum r w^2 v] over each component's points for every column v,
        w = 1 / (s_m + e): (k, a, 2, q + 2)."""
        total = spreads[:, None, None] + self.noise
        weights = np.empty(total.shape[:2] + (2, total.shape[2]))
        np.divide(self.r, total, out=weights[:, :, 0])
        np.divide(weights[:, :, 0], total, out=weights[:, :, 1])
        return np.asarray(weights @ self.values)

    def keep(self, mask: np.ndarray) -> None:
        """Drop the components whose fixed point has settled."""
        self.r, self.noise, self.counts = self.r[mask], self.noise[mask], self.counts[mask]
        self.values, self.centres = self.values[mask], self.centres[mask]


def _on_own_axes(points: np.ndarray, axes: np.ndarray, index: np.ndarray) -> np.ndarray:
    """points[index[m]] (K, w, d) with the axes beyond ``axes[m]`` 0 (only isotropic noise has
    components on fewer axes than the points: a fit on fewer axes beside others). By
    ``np.take`` of one flat index, ~3x faster than fancy indexing at 1,000 silos."""
    n, d = points.shape
    if np.all(axes == d):
        return np.take(points, index, axis=0)
    levels, level = np.unique(axes, return_inverse=True)
    own = np.where(np.arange(d) < levels[:, None, None], points, 0.0)  # (L, n, d)
    return np.take(own.reshape(-1, d), level[:, None] * n + index, axis=0)


def _seed_weights(points: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """k-means++ weights 1 / (s_0 + mean_k e_ik), s_0 the squared median nearest-neighbour
    distance per axis: a point much noisier than the data's local spread is rarely a seed
    (it would start a component on an outlier); equal weights, today's seeds, when every
    e_ik is 0. The pairwise distances come from ``cdist``, which needs no (n, n, d) array
    (1,000 silos: 9 candidates x 72 MB of temporaries otherwise)."""
    excess = noise.mean(axis=1)
    if not np.any(excess > 0):
        return np.ones(len(points))
    squared = cdist(points, points, "sqeuclidean")
    np.fill_diagonal(squared, np.inf)
    spread = float(np.median(squared.min(axis=1))) / points.shape[1]
    return np.asarray(1.0 / (max(spread, REG_COVAR) + excess))


def _noise_columns(noise: np.ndarray, n: int, d: int) -> np.ndarray:
    """e_ik as (n, 1) when every axis of a point carries the same excess noise (the
    clusterer's case, which the EM then sums once per point), otherwise (n, d)."""
    e = np.asarray(noise, dtype=np.float64).reshape(n, -1)
    if e.shape[1] not in (1, d):
        raise ValueError(f"noise must hold one variance per point or per point and axis "
                         f"({n} or {n} x {d}), got shape {np.shape(noise)}")
    if np.any(e < 0) or not np.all(np.isfinite(e)):
        raise ValueError("noise variances must be finite and non-negative")
    return e[:, :1] if np.all(e == e[:, :1]) else e


def fit_noise_aware_gmm(
    points: np.ndarray, noise: np.ndarray, n_clusters: int, random_state: int = 0,
    tol: float = 1e-6, max_iter: int = 100, reg_covar: float = REG_COVAR,
    inner_steps: int = 20,
) -> GMMFit:
    """Mixture of N(mu_m, diag(s_m + e_ik)) fitted by EM; ``noise`` holds e_ik, each point's
    known excess noise variance per axis ((n,) or (n, d)). Same start as
    :func:`~.gmm.fit_spherical_gmm` (k-means++ seeds, uniform weights, sklearn's stopping
    rule on the mean log-likelihood); radii sqrt(s_m) give MSS and MPO (A16)."""
    axes = {n_clusters: np.shape(points)[1]}
    return fit_noise_aware_gmms(points, noise, axes, random_state, tol, max_iter, reg_covar,
                                inner_steps)[n_clusters]


def fit_noise_aware_gmms(
    points: np.ndarray, noise: np.ndarray, axes: Mapping[int, int], random_state: int = 0,
    tol: float = 1e-6, max_iter: int = 100, reg_covar: float = REG_COVAR,
    inner_steps: int = 20,
) -> dict[int, GMMFit]:
    """:func:`fit_noise_aware_gmm` for several numbers of clusters at once, M clusters on the
    first ``axes[M]`` axes of the (n, d) ``points`` and of ``noise``: the clusterer's
    candidates. Returns M -> the fit ``fit_noise_aware_gmm`` gives on those axes.

    Why together: at 1,000 silos one EM iteration of one candidate is some 40 numpy calls
    on small arrays, whose overhead made most of the nine candidates' time (bench/scaling.py,
    server part). Side by side, an iteration makes those calls once for every candidate
    still iterating. Each component's arithmetic stays its own, so every fit is its separate
    fit's up to rounding. With noise per axis, only fits on the same axes go side by side."""
    x = np.asarray(points, dtype=np.float64)
    n, d = x.shape
    e = _noise_columns(noise, n, d)
    if not axes:
        raise ValueError("no number of clusters to fit")
    for n_clusters, count in axes.items():
        if not 2 <= n_clusters <= n:
            raise ValueError(f"cannot fit {n_clusters} clusters to {n} points")
        if not 1 <= count <= d:
            raise ValueError(f"cannot fit {n_clusters} clusters on {count} of {d} axes")
    if e.shape[1] == 1:
        return _fit_side_by_side(x[:, :max(axes.values())], e, axes, random_state, tol,
                                 max_iter, reg_covar, inner_steps)
    fits: dict[int, GMMFit] = {}
    for count in sorted(set(axes.values())):
        fits.update(_fit_side_by_side(
            x[:, :count], _noise_columns(e[:, :count], n, count),
            {m: k for m, k in axes.items() if k == count}, random_state, tol, max_iter,
            reg_covar, inner_steps))
    return {n_clusters: fits[n_clusters] for n_clusters in axes}


def _fit_side_by_side(x: np.ndarray, e: np.ndarray, axes: Mapping[int, int],
                      random_state: int, tol: float, max_iter: int, reg_covar: float,
                      inner_steps: int) -> dict[int, GMMFit]:
    """:func:`fit_noise_aware_gmms` on points ``x`` whose noise ``e`` is (n, 1), or (n, d)
    with every fit on all d axes. A mixture's components are consecutive rows (K = the sum
    of the M) and ``owner`` names each row's mixture; the radii use the uniform weights of
    the authors' soft assignment, whatever EM estimated."""
    sizes = np.array(list(axes), dtype=np.intp)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    component_axes = np.repeat(np.array(list(axes.values()), dtype=np.intp), sizes)
    means, variances, n_iter, converged = _em_side_by_side(
        x, e, _seed_responsibilities(x, e, axes, random_state), component_axes, owner, tol,
        max_iter, reg_covar, inner_steps)
    joint = _log_densities(x, e, means, variances, component_axes)
    responsibilities = _exp(joint - _log_sum_exp(joint, owner).T[:, owner])
    fits = {}
    for mixture, (n_clusters, count) in enumerate(axes.items()):
        mine = owner == mixture
        resp = responsibilities[:, mine]
        radii = component_radii(variances[mine], resp, e)
        mss = float(separation_scores(means[mine, :count], radii).min())
        fits[n_clusters] = GMMFit(means[mine, :count], radii, resp, int(n_iter[mixture]),
                                  bool(converged[mixture]), mss, overlap(mss), variances[mine])
    return fits


def _seed_responsibilities(x: np.ndarray, e: np.ndarray, axes: Mapping[int, int],
                           random_state: int) -> np.ndarray:
    """(n, K) one-hot columns of every mixture's k-means++ seeds, M on its first axes[M] axes
    from its own ``RandomState(random_state)``, weighted by :func:`_seed_weights` (one
    n x n distance matrix per number of axes)."""
    from sklearn.cluster import kmeans_plusplus  # only where a mixture is fitted (gmm.py)

    weights: dict[int, np.ndarray] = {}
    columns = []
    for n_clusters, count in axes.items():
        if count not in weights:
            weights[count] = _seed_weights(x[:, :count], e[:, :count])
        _, seeds = kmeans_plusplus(x[:, :count], n_clusters,
                                   random_state=np.random.RandomState(random_state),
                                   sample_weight=weights[count])
        one_hot = np.zeros((len(x), n_clusters))
        one_hot[seeds, np.arange(n_clusters)] = 1.0
        columns.append(one_hot)
    return np.concatenate(columns, axis=1)


def _em_side_by_side(
    x: np.ndarray, e: np.ndarray, resp: np.ndarray, axes: np.ndarray, owner: np.ndarray,
    tol: float, max_iter: int, reg_covar: float, inner_steps: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """EM from the seeds' responsibilities ``resp`` (n, K) for the mixtures side by side, each
    with uniform starting weights and sklearn's stopping rule on its own mean log-likelihood
    (change below ``tol``, at most ``max_iter`` iterations). A mixture that stops leaves the
    batch with the means and spreads of its last M-step. Returns means (K, d), spreads (K,),
    and per mixture its iterations and whether it converged."""
    # one seed point each: spread 0, so s_m = reg_covar
    means, variances = _m_step(x, e, resp, np.full(len(owner), reg_covar), reg_covar, 1, axes)
    sizes = np.bincount(owner)
    log_weights = np.concatenate([np.full(m, -math.log(m)) for m in sizes])
    final_means, final_variances = means.copy(), variances.copy()
    n_iter, converged = np.zeros(len(sizes), dtype=np.intp), np.zeros(len(sizes), dtype=bool)
    live, bound = np.arange(len(sizes)), np.full(len(sizes), -np.inf)  # per iterating mixture
    rows = np.arange(len(owner))  # the iterating components' rows in final_means
    for iteration in range(1, max_iter + 1):
        joint = _log_densities(x, e, means, variances, axes) + log_weights
        norm = _log_sum_exp(joint, owner)  # (mixtures, n)
        resp = _exp(joint - norm.T[:, owner])
        means, variances = _m_step(x, e, resp, variances, reg_covar, inner_steps, axes)
        mass = resp.sum(axis=0) + 10 * np.finfo(float).eps
        log_weights = np.log(mass / np.add.reduceat(mass, _first_columns(owner))[owner])
        previous, bound = bound, norm.mean(axis=1)
        stopped = np.abs(bound - previous) < tol
        n_iter[live], converged[live] = iteration, stopped
        stopped |= iteration == max_iter
        if stopped.any():
            done = stopped[owner]
            final_means[rows[done]], final_variances[rows[done]] = means[done], variances[done]
            kept = ~done
            means, variances, log_weights = means[kept], variances[kept], log_weights[kept]
            axes, rows = axes[kept], rows[kept]
            owner = (np.cumsum(~stopped) - 1)[owner[kept]]
            live, bound = live[~stopped], bound[~stopped]
            if not len(live):
                break
    return final_means, final_variances, n_iter, converged


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

    def fit(self, updates: UpdateMatrix,
            reported: Sequence[float | None] | None = None) -> NoiseAwareClusterer:
        """Fit on an (n clients, p parameters) matrix of round-1 updates."""
        with one_blas_thread():  # its small products run faster on one (..blas_threads)
            return self._fit_with_noise(updates, reported)

    def _fit_with_noise(self, updates: UpdateMatrix,
                        reported: Sequence[float | None] | None) -> NoiseAwareClusterer:
        n_points = updates.shape[0]
        candidates = self._candidates(n_points)
        dims = {m: self._dimension(m, n_points) for m in candidates}
        gram, trained = update_gram(updates)
        check_norm_spread(gram)
        self.estimated_noise_variances_ = (np.zeros(n_points) if self.noise_source == "plan"
                                           else residual_noise_variances(gram, trained))
        self.noise_variances_ = combine_noise(reported, self.estimated_noise_variances_,
                                              self.noise_source, self.tolerance)
        self.projection_ = debiased_projection(gram, self.noise_variances_, max(dims.values()))
        scaled, factor = scale_isotropically(self.projection_, self.scaler)
        excess = self.noise_variances_ - self.noise_variances_.min()
        self.excess_noise_ = np.repeat(excess[:, None] / factor**2, scaled.shape[1], axis=1)
        fits = fit_noise_aware_gmms(scaled, self.excess_noise_, dims, self.random_state,
                                    self.tol, self.max_iter)
        self._keep(fits, {m: scaled[:, :dims[m]] for m in fits})
        return self
