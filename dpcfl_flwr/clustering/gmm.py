"""The server's clustering of round-1 updates: projection, scaling, spherical GMM, MSS/MPO.

docs/algorithm.md#stage-1-clustering-the-round-1-updates states the pipeline (A4-A8).

Round-1 updates of clients in one cluster are draws from one isotropic Gaussian (Lemma 4.1), so
a spherical GMM fits them; its separation score MSS = min over pairs of
||mu_m - mu_m'|| / (2 max(r_m, r_m')) and overlap MPO = 2 Q(MSS) say how trustworthy the fit is,
and set the switch round E_c = floor((1 - MPO) E / 2). All of it is post-processing of DP
outputs and costs no privacy.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..blas_threads import one_blas_thread, outer_blas_threads
from .blocks import UpdateMatrix, column_blocks
from .eigen import top_eigenpairs


def project_updates(updates: UpdateMatrix, n_components: int = 2) -> np.ndarray:
    """The authors' projection: principal axes of the per-parameter standardised updates,
    applied to the raw updates (docs/algorithm.md#projection, A4). Returns an
    (n, n_components) array.

    Computed from n x n Gram matrices, which equals sklearn's StandardScaler + PCA up to the
    sign of each axis (irrelevant downstream: scaling and the GMM are reflection-equivariant).
    """
    # Anything with .shape and 2-D slicing works (a lazy matrix that makes column blocks on
    # demand, e.g. 210 ResNet updates in bench/), so do not force it into memory here.
    x = updates if hasattr(updates, "shape") and hasattr(updates, "__getitem__") else (
        np.asarray(updates))
    n, p = x.shape
    if n < 2 or p < 1:
        raise ValueError(f"need at least 2 updates with >= 1 parameter, got shape {x.shape}")
    # Pass 1: the Gram matrix of the standardised updates, whose top eigenvectors V are the
    # principal axes' coefficients. Pass 2: the raw updates on those axes, X (S^T V) / s, one
    # block at a time; this is X S^T V without the n x n product X S^T, which at 1,000 silos
    # cost as much as the Gram matrix itself (bench/scaling.py, server part).
    gram = np.zeros((n, n))
    scalings = []
    for block in column_blocks(x):
        mean = block.mean(axis=0)
        scaled = block - mean
        std = np.sqrt(np.einsum("ij,ij->j", scaled, scaled) / n)
        std[std == 0] = 1.0  # constant parameters carry no direction (as StandardScaler does)
        scaled /= std
        with outer_blas_threads():  # n^2 p multiply-adds: the one step more threads speed up
            gram += scaled @ scaled.T
        scalings.append(std)
    eigenvalues, eigenvectors = top_eigenpairs(gram, n_components)
    singular = np.sqrt(np.clip(eigenvalues, 0.0, None))
    if np.any(singular <= 1e-12 * max(singular.max(initial=0.0), 1.0)):
        raise ValueError("the updates span fewer than 2 directions; nothing to cluster")
    axes = eigenvectors / singular
    projection = np.zeros((n, len(singular)))
    for std, block in zip(scalings, column_blocks(x), strict=True):
        # S^T V for this block's columns without forming S again: S = (X - 1 mean^T) / std,
        # and the centring drops out because V is orthogonal to 1 (S^T 1 = 0, so G 1 = 0)
        projection += block @ ((block.T @ axes) / std[:, None])
    return projection


def scale_points(points: np.ndarray, scaler: str = "minmax") -> np.ndarray:
    """Map each axis to [0, 1] (``minmax``, the authors' default) or to zero mean, unit std."""
    if scaler == "minmax":
        span = points.max(axis=0) - points.min(axis=0)
        return (points - points.min(axis=0)) / np.where(span > 0, span, 1.0)
    if scaler == "standard":
        std = points.std(axis=0)
        return (points - points.mean(axis=0)) / np.where(std > 0, std, 1.0)
    raise ValueError(f"scaler must be 'minmax' or 'standard', got {scaler!r}")


def separation_scores(means: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """SS(m, m') = ||mu_m - mu_m'|| / (2 max(r_m, r_m')), with +inf on the diagonal."""
    distances = np.linalg.norm(means[:, None, :] - means[None, :, :], axis=-1)
    scores = distances / (2 * np.maximum(radii[:, None], radii[None, :]))
    np.fill_diagonal(scores, np.inf)
    return scores


def overlap(score: float) -> float:
    """Pairwise overlap 2 Q(SS) = erfc(SS / sqrt 2) of two equal spherical Gaussians."""
    return math.erfc(score / math.sqrt(2))


@dataclass(frozen=True)
class GMMFit:
    """One spherical GMM fitted to the projected points, with uniform weights
    (docs/algorithm.md#spherical-gmm, A5; MSS and MPO: A6)."""

    means: np.ndarray
    radii: np.ndarray
    responsibilities: np.ndarray
    n_iter: int
    converged: bool
    mss: float
    mpo: float
    #: sigma_m^2, the spread of each component besides its members' own noise (the
    #: noise-aware fit, docs/algorithm.md#noise-aware-clustering); None: radii**2
    spreads: np.ndarray | None = None


def load_mixture_code() -> None:
    """Import what fitting a mixture takes (scikit-learn's mixture and its k-means++ seeding,
    0.07-0.1 s) now: a server that will cluster round 1 calls this when it starts, while the
    silos train, instead of paying for it inside round 1's clustering, where the server's time
    adds to the round."""
    import sklearn.cluster  # noqa: F401
    import sklearn.mixture  # noqa: F401


def fit_spherical_gmm(
    points: np.ndarray, n_clusters: int, random_state: int = 0, tol: float = 1e-6,
    max_iter: int = 100,
) -> GMMFit:
    """Spherical GMM with k-means++ init and uniform weights, as the authors fit it."""
    if not 2 <= n_clusters <= len(points):
        raise ValueError(f"cannot fit {n_clusters} clusters to {len(points)} points")
    # scikit-learn (and the pandas it loads, ~70 MB) only where a mixture is fitted: every
    # process that reads a run config imports R-DPCFL's module, silos included
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import GaussianMixture

    uniform = np.full(n_clusters, 1.0 / n_clusters)
    gmm = GaussianMixture(
        n_components=n_clusters, covariance_type="spherical", init_params="k-means++",
        tol=tol, max_iter=max_iter, random_state=random_state, weights_init=uniform,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        gmm.fit(points)
    gmm.weights_ = uniform  # the authors force uniform weights before the soft assignment
    radii = np.sqrt(gmm.covariances_)
    mss = float(separation_scores(gmm.means_, radii).min())
    return GMMFit(
        gmm.means_, radii, gmm.predict_proba(points), int(gmm.n_iter_), bool(gmm.converged_),
        mss, overlap(mss),
    )


def switch_round(mpo: float, rounds: int) -> int:
    """E_c = floor((1 - MPO) * E / 2): the last round of the soft-clustering stage."""
    if not 0.0 <= mpo <= 1.0:
        raise ValueError(f"MPO must lie in [0, 1], got {mpo}")
    return int(math.floor((1.0 - mpo) * rounds / 2))


class UpdateClusterer:
    """Clusters clients from their round-1 updates; reads like a scikit-learn estimator.

    With ``n_clusters=None`` a mixture is fitted for every M of ``candidate_clusters`` (2..10
    by default, capped at n - 1) and the one of largest MSS is kept (the authors' rule);
    :func:`.model_order.fit_model_order` then weighs each against a null of no structure and
    may keep another, or one cluster (:meth:`keep_clusters`).

    ``n_components`` is the projection's dimension: the authors' code uses 2; ``None`` uses
    M - 1 (at least 2) for each candidate M, the dimension the M cluster means span. With 2
    axes four clusters can overlap in the picture although they are far apart in the updates
    (bench/RESULTS.md: on Fashion-MNIST with N_i = 500 the round-1 partition went from exact
    in 2 of 6 seeds to exact in 6 of 6).

    After ``fit``: ``points_`` (the scaled projection used), ``n_clusters_``, ``means_``,
    ``radii_``, ``responsibilities_`` (pi_i, n x M), ``labels_``, ``mss_``, ``mpo_``,
    ``n_iter_`` (EM iterations), ``converged_``, ``candidate_mss_`` (M -> MSS) and
    ``fits_`` (M -> :class:`GMMFit`).
    """

    def __init__(
        self, n_clusters: int | None = None,
        candidate_clusters: Sequence[int] = tuple(range(2, 11)), scaler: str = "minmax",
        tol: float = 1e-6, max_iter: int = 100, random_state: int = 0,
        n_components: int | None = 2,
    ) -> None:
        self.n_clusters = n_clusters
        self.n_components = n_components
        self.candidate_clusters = tuple(candidate_clusters)
        self.scaler = scaler
        self.tol = tol
        self.max_iter = max_iter
        self.random_state = random_state

    def _candidates(self, n_points: int) -> list[int]:
        if self.n_clusters is not None:
            return [self.n_clusters]
        candidates = [m for m in self.candidate_clusters if 2 <= m < n_points]
        if not candidates:
            raise ValueError(f"no candidate number of clusters fits {n_points} clients")
        return candidates

    def _dimension(self, n_clusters: int, n_points: int) -> int:
        wanted = self.n_components if self.n_components else max(2, n_clusters - 1)
        return max(2, min(wanted, n_points - 1))

    def fit(self, updates: UpdateMatrix,
            reported: Sequence[float | None] | None = None) -> UpdateClusterer:
        """Fit on an (n clients, p parameters) matrix of round-1 updates. ``reported``, each
        silo's planned noise variance, is for mixtures that use it; this one does not."""
        with one_blas_thread():  # its small products run faster on one (..blas_threads)
            return self._fit(updates)

    def _fit(self, updates: UpdateMatrix) -> UpdateClusterer:
        n_points = updates.shape[0]
        candidates = self._candidates(n_points)
        dims = {m: self._dimension(m, n_points) for m in candidates}
        # Principal axes are nested, so one projection serves every candidate's dimension.
        self.projection_ = project_updates(updates, max(dims.values()))
        scaled = scale_points(self.projection_, self.scaler)  # per axis, so slices stay scaled
        fits = {m: fit_spherical_gmm(scaled[:, :dims[m]], m, self.random_state, self.tol,
                                     self.max_iter) for m in candidates}
        self._keep(fits, {m: scaled[:, :dims[m]] for m in fits})
        return self

    def _keep(self, fits: dict[int, GMMFit], points: dict[int, np.ndarray]) -> None:
        """Keep every candidate's fit and the points it saw; use the one of largest MSS (the
        fewest clusters among ties)."""
        self.fits_ = fits
        self._points_by_order = points
        self.candidate_mss_ = {m: fit.mss for m, fit in fits.items()}
        self.keep_clusters(max(fits, key=lambda m: (fits[m].mss, -m)))

    def keep_clusters(self, n_clusters: int) -> None:
        """Use the fit with ``n_clusters`` components, or (1) one cluster holding every silo:
        MSS 0 and MPO 1, there being no pair of clusters to separate."""
        if n_clusters == 1:
            points = self._points_by_order[min(self._points_by_order)]
            spread = float(np.sqrt(((points - points.mean(axis=0)) ** 2).sum(axis=1).mean()))
            best = GMMFit(points.mean(axis=0, keepdims=True), np.array([spread]),
                          np.ones((len(points), 1)), 0, True, 0.0, 1.0)
        else:
            best = self.fits_[n_clusters]
            points = self._points_by_order[n_clusters]
        self.n_clusters_ = n_clusters
        self.points_ = points
        self.means_, self.radii_ = best.means, best.radii
        self.responsibilities_ = best.responsibilities
        self.labels_ = best.responsibilities.argmax(axis=1)
        self.mss_, self.mpo_ = best.mss, best.mpo
        self.n_iter_, self.converged_ = best.n_iter, best.converged
