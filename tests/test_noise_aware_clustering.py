"""Noise-aware round-1 clustering (docs/algorithm.md#noise-aware-clustering): the numpy core
on synthetic mixtures whose right answer is known, and R-DPCFL selecting it."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import Message
from sklearn.metrics import adjusted_rand_score

from dpcfl_flwr.clustering import (
    NoiseAwareClusterer,
    StackedRows,
    UpdateClusterer,
    blocks,
    combine_noise,
    debiased_projection,
    eigen,
    fit_noise_aware_gmm,
    fit_spherical_gmm,
    residual_noise_variances,
    switch_round,
    update_gram,
)
from dpcfl_flwr.clustering.noise_aware import _signal_axes, fit_noise_aware_gmms, signal_gram
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.methods.base import INITIAL
from dpcfl_flwr.protocol import METRICS, UPDATE, ModelLayout, one_record, pack
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import ClusteredStrategy

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to the labels' names."""
    return bool(np.array_equal(a[:, None] == a[None, :], b[:, None] == b[None, :]))


# --- the mixture ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_clusters", [2, 3, 4])
def test_with_equal_noise_it_is_todays_spherical_gmm(seed, n_clusters):
    """Every v_i equal: no excess noise, and the fit, MSS, MPO and E_c are today's."""
    rng = np.random.default_rng(seed)
    points = np.concatenate([rng.normal(c, 0.1, (7, 2)) for c in ([0, 0], [1, 0], [0, 1])])
    today = fit_spherical_gmm(points, n_clusters, seed)
    aware = fit_noise_aware_gmm(points, np.zeros(len(points)), n_clusters, seed)
    assert aware.n_iter == today.n_iter and aware.converged == today.converged
    for mine, theirs in [(aware.means, today.means), (aware.radii, today.radii),
                         (aware.responsibilities, today.responsibilities)]:
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-9)
    np.testing.assert_allclose(aware.spreads, today.radii**2, rtol=1e-9)
    assert aware.mss == pytest.approx(today.mss, abs=1e-9)
    assert aware.mpo == pytest.approx(today.mpo, abs=1e-9)
    assert switch_round(aware.mpo, 200) == switch_round(today.mpo, 200)


def _two_noise_levels(seed: int, n: int = 400):
    """Two clusters 8 apart (spreads 1 and 1.5); every other pair of points carries extra
    noise of variance 99 (std ~10: about 100x the variance of the quiet points)."""
    rng = np.random.default_rng(seed)
    truth = np.arange(n) % 2
    noisy = (np.arange(n) // 2) % 2 == 1
    means, spreads = np.array([[0.0, 0.0], [8.0, 0.0]]), np.array([1.0, 1.5])
    excess = np.where(noisy, 99.0, 0.0)
    total = spreads[truth] ** 2 + excess
    return means, spreads, truth, noisy, excess, means[truth] + rng.normal(
        size=(n, 2)) * np.sqrt(total)[:, None]


@pytest.mark.parametrize("seed", range(4))
def test_known_noise_recovers_the_clusters_where_todays_gmm_splits_by_noise(seed):
    means, spreads, truth, noisy, excess, points = _two_noise_levels(seed)
    today = fit_spherical_gmm(points, 2, seed).responsibilities.argmax(axis=1)
    # Today's mixture puts the quiet points in one tight component, the noisy in a wide one.
    assert adjusted_rand_score(truth, today) < 0.05
    assert adjusted_rand_score(noisy, today) > 0.4
    fit = fit_noise_aware_gmm(points, excess, 2, seed)
    labels = fit.responsibilities.argmax(axis=1)
    assert _same_partition(labels[~noisy], truth[~noisy])
    # The right answer for each point: Bayes' rule with the true means, spreads and noise.
    total = spreads[None, :] ** 2 + excess[:, None]
    log_density = -np.log(total) - np.sum(
        (points[:, None, :] - means[None]) ** 2, axis=2) / (2 * total)
    bayes = log_density.argmax(axis=1)
    assert max(np.mean(labels == bayes), np.mean(labels != bayes)) >= 0.99
    order = np.argsort(fit.means[:, 0])  # component near 0, then near 8
    np.testing.assert_allclose(fit.means[order], means, atol=0.5)
    np.testing.assert_allclose(np.sqrt(fit.spreads[order]), spreads, rtol=0.2)


def test_a_components_radius_counts_its_members_noise():
    """r_m^2 = sigma_m^2 + the members' mean excess noise: a component of noisy points is
    wide, so it cannot pass for a confident cluster of its own."""
    _, _, _, noisy, excess, points = _two_noise_levels(0)
    fit = fit_noise_aware_gmm(points, excess, 2, 0)
    member_noise = fit.responsibilities.T @ excess / fit.responsibilities.sum(axis=0)
    np.testing.assert_allclose(fit.radii**2, fit.spreads + member_noise, rtol=1e-6)
    assert 0 < fit.mss < 1  # 8 apart, members' std ~7: heavy overlap, and it says so


# --- the fit against the EM as first written --------------------------------------------------
def _reference_fit(points, noise, n_clusters, seed, tol=1e-6, max_iter=100, reg=1e-6,
                   inner_steps=20):
    """The noise-aware EM written plainly: one component at a time, every point, (n, d)
    noise, scipy's logsumexp. The fit's rewrite (all components at once, each over the
    points it reaches, squared distances about the plain weighted mean, isotropic noise
    summed once per point) must give the same fit."""
    from scipy.special import logsumexp
    from sklearn.cluster import kmeans_plusplus
    x = np.asarray(points, dtype=float)
    n, d = x.shape
    e = np.broadcast_to(np.asarray(noise, dtype=float).reshape(n, -1), (n, d))
    excess = e.mean(axis=1)
    weights = np.ones(n)
    if np.any(excess > 0):
        squared = np.sum((x[:, None] - x[None]) ** 2, axis=2)
        np.fill_diagonal(squared, np.inf)
        weights = 1 / (max(np.median(squared.min(axis=1)) / d, reg) + excess)
    _, seeds = kmeans_plusplus(x, n_clusters, random_state=np.random.RandomState(seed),
                               sample_weight=weights)

    def m_step(r, variance, steps):
        mass = r.sum() + 10 * np.finfo(float).eps
        mean = r @ x / mass
        for _ in range(steps):
            w = 1 / (variance + e)
            mean = (r @ (w * x)) / (r @ w + 1e-300) * (r.sum() / mass)
            w2 = r[:, None] * w**2
            updated = max(np.sum(w2 * ((x - mean) ** 2 - e)) / (np.sum(w2) + 1e-300), 0) + reg
            settled = abs(updated - variance) <= 1e-12 * max(updated, reg)
            variance = updated
            if settled:
                break
        return mean, variance

    def log_densities(means, variances):
        total = variances[None, :, None] + e[:, None, :]
        return -0.5 * np.sum(np.log(2 * math.pi * total)
                             + (x[:, None] - means[None]) ** 2 / total, axis=2)

    resp = np.zeros((n, n_clusters))
    resp[seeds, np.arange(n_clusters)] = 1
    means, variances = np.zeros((n_clusters, d)), np.zeros(n_clusters)
    for m in range(n_clusters):
        means[m], variances[m] = m_step(resp[:, m], reg, 1)
    log_weights, bound = np.full(n_clusters, -math.log(n_clusters)), -np.inf
    for n_iter in range(1, max_iter + 1):  # noqa: B007
        joint = log_densities(means, variances) + log_weights
        norm = logsumexp(joint, axis=1)
        resp = np.exp(joint - norm[:, None])
        for m in range(n_clusters):
            means[m], variances[m] = m_step(resp[:, m], variances[m], inner_steps)
        mass = resp.sum(axis=0) + 10 * np.finfo(float).eps
        log_weights = np.log(mass / mass.sum())
        previous, bound = bound, norm.mean()
        if abs(bound - previous) < tol:
            break
    joint = log_densities(means, variances)
    return means, variances, np.exp(joint - logsumexp(joint, axis=1)[:, None]), n_iter


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n_clusters", [2, 3, 5])
@pytest.mark.parametrize("noise_kind", ["per point", "per point and axis"])
def test_the_fit_is_the_plain_em(seed, n_clusters, noise_kind):
    rng = np.random.default_rng(seed)
    *_, excess, points = _two_noise_levels(seed, n=120)
    points = np.column_stack([points, rng.normal(size=len(points))])
    if noise_kind == "per point":
        noise = np.repeat(excess[:, None], 3, axis=1)  # the clusterer's (n, d) of equal columns
    else:
        noise = excess[:, None] * rng.uniform(0.5, 1.5, (len(points), 3))
    means, spreads, responsibilities, n_iter = _reference_fit(points, noise, n_clusters, seed)
    fit = fit_noise_aware_gmm(points, noise, n_clusters, seed)
    assert fit.n_iter == n_iter
    np.testing.assert_allclose(fit.means, means, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fit.spreads, spreads, rtol=1e-9)
    np.testing.assert_allclose(fit.responsibilities, responsibilities, rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("noise_kind", ["per point", "per point and axis"])
def test_fits_side_by_side_are_each_the_plain_em_on_its_axes(seed, noise_kind):
    """The clusterer's candidates fitted together (M clusters on the first max(2, M - 1)
    axes, stopping after different numbers of iterations) are each the plain EM on its own
    axes, as if fitted alone."""
    rng = np.random.default_rng(seed)
    *_, excess, points = _two_noise_levels(seed, n=120)
    points = np.column_stack([points, rng.normal(size=(len(points), 2))])
    if noise_kind == "per point":
        noise = np.repeat(excess[:, None], 4, axis=1)
    else:
        noise = excess[:, None] * rng.uniform(0.5, 1.5, (len(points), 4))
    axes = {n_clusters: max(2, n_clusters - 1) for n_clusters in range(2, 6)}
    fits = fit_noise_aware_gmms(points, noise, axes, seed, max_iter=30)
    assert list(fits) == list(axes)
    iterations = set()
    for n_clusters, count in axes.items():
        means, spreads, responsibilities, n_iter = _reference_fit(
            points[:, :count], noise[:, :count], n_clusters, seed, max_iter=30)
        fit = fits[n_clusters]
        assert fit.n_iter == n_iter and fit.means.shape == (n_clusters, count)
        np.testing.assert_allclose(fit.means, means, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(fit.spreads, spreads, rtol=1e-9)
        np.testing.assert_allclose(fit.responsibilities, responsibilities, rtol=0, atol=1e-9)
        iterations.add(n_iter)
    assert len(iterations) > 1  # some fits left the batch before others


@pytest.mark.parametrize("lanczos_from", [eigen.LANCZOS_FROM, 1])
def test_the_projection_steps_are_their_plain_forms(monkeypatch, lanczos_from):
    """diag(G^-1) from a Cholesky factor, the centring by means and the top eigenpairs
    alone (from LAPACK, and from Lanczos as at many silos) against the eigendecompositions
    and n x n products they replace; axes agree up to their sign, which scaling and the
    mixture do not see."""
    monkeypatch.setattr(eigen, "LANCZOS_FROM", lanczos_from)
    truth, variances, updates = _updates(seed=2, n=24, p=3_000)
    gram, trained = update_gram(updates)
    scale = np.trace(gram) / len(gram)
    values, vectors = np.linalg.eigh(gram / scale)
    plain = scale / ((vectors**2) @ (1 / values)) / (trained - len(gram) + 1)
    np.testing.assert_allclose(residual_noise_variances(gram, trained), plain, rtol=1e-9)
    singular = updates[:, :10]  # 24 updates in 10 coordinates: G is singular
    gram10, _ = update_gram(singular)
    values, vectors = np.linalg.eigh(gram10 / (np.trace(gram10) / 24))
    floored = (vectors**2) @ (1 / np.clip(values, 1e-12 * values.max(), None))
    np.testing.assert_allclose(residual_noise_variances(gram10, 10),
                               np.trace(gram10) / 24 / floored / 1, rtol=1e-9)

    signal = signal_gram(gram, 4)
    off, diagonal = gram - np.diag(np.diag(gram)), np.zeros(len(gram))
    for _ in range(20):
        w, v = np.linalg.eigh(off + np.diag(diagonal))
        fitted = (v[:, -4:] ** 2) @ np.clip(w[-4:], 0, None)
        settled = np.abs(fitted - diagonal).max() <= 1e-6 * np.abs(fitted).max()
        diagonal = fitted
        if settled:
            break
    np.testing.assert_allclose(signal, off + np.diag(diagonal), rtol=1e-9,
                               atol=1e-12 * np.abs(gram).max())

    centring = np.eye(len(gram)) - 1 / len(gram)
    whiten = 1 / np.sqrt(variances)
    w, v = np.linalg.eigh(whiten[:, None] * (centring @ signal @ centring) * whiten[None])
    plain_axes = centring @ (whiten[:, None] * v[:, ::-1][:, :3])
    axes, ratios = _signal_axes(signal, variances, 3)
    np.testing.assert_allclose(ratios, w[::-1][:3], rtol=1e-9)
    signs = np.sign(np.sum(axes * plain_axes, axis=0))
    np.testing.assert_allclose(axes * signs, plain_axes, rtol=0,
                               atol=1e-9 * np.abs(plain_axes).max())



def test_where_lanczos_fails_lapack_answers():
    """ARPACK cannot start on a zero matrix (all updates alike, or orthogonal to each
    other): the pairs then come from LAPACK, as below LANCZOS_FROM silos, not an error."""
    n = eigen.LANCZOS_FROM
    values, vectors = eigen.top_eigenpairs(np.zeros((n, n)), 3)
    assert values.tolist() == [0.0, 0.0, 0.0] and vectors.shape == (n, 3)
    np.testing.assert_allclose(vectors.T @ vectors, np.eye(3), atol=1e-12)

# --- updates in high dimension ----------------------------------------------------------------
def _updates(seed: int = 0, p: int = 20_000, n: int = 20):
    """Two clusters at +-100 u (u a unit vector); per coordinate, half the silos of each
    cluster carry noise of variance 1, the other half 100."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=p)
    direction /= np.linalg.norm(direction)
    truth = np.arange(n) % 2
    variances = np.where(np.arange(n) % 4 < 2, 1.0, 100.0)
    centres = np.stack([100 * direction, -100 * direction])
    return truth, variances, centres[truth] + rng.normal(size=(n, p)) * np.sqrt(
        variances)[:, None]


@pytest.mark.parametrize("n_clusters", [2, None])
def test_updates_with_100x_noise_today_splits_by_noise_noise_aware_finds_the_clusters(
        n_clusters):
    truth, variances, updates = _updates()
    today = UpdateClusterer(n_clusters, range(2, 6), n_components=None).fit(updates)
    assert adjusted_rand_score(truth, today.labels_) < 0.1
    for source in ("plan", "estimate", "larger"):
        fitted = NoiseAwareClusterer(n_clusters, range(2, 6), n_components=None,
                                     noise_source=source).fit(updates, list(variances))
        assert fitted.n_clusters_ == 2
        assert _same_partition(fitted.labels_, truth)
        assert fitted.mss_ > 3 and fitted.responsibilities_.max(axis=1).min() > 0.999


def test_with_equal_noise_the_clusterer_finds_todays_partition_with_todays_mixture():
    """Equal v_i: no excess noise, the mixture on the clusterer's points is the spherical
    GMM's, and the partition is today's (here the true one)."""
    rng = np.random.default_rng(3)
    truth = np.repeat([0, 1, 2], [3, 6, 6])
    centres = rng.normal(size=(3, 5000))
    updates = centres[truth] + 2.0 * rng.normal(size=(len(truth), 5000))
    today = UpdateClusterer(None, range(2, 6), n_components=None).fit(updates)
    aware = NoiseAwareClusterer(None, range(2, 6), n_components=None).fit(
        updates, [4.0] * len(truth))
    assert not np.any(aware.excess_noise_)
    assert _same_partition(aware.labels_, today.labels_) and _same_partition(today.labels_,
                                                                             truth)
    assert aware.n_clusters_ == today.n_clusters_ == 3
    spherical = fit_spherical_gmm(aware.points_, 3, 0)
    np.testing.assert_allclose(aware.responsibilities_, spherical.responsibilities, atol=1e-9)
    assert aware.mss_ == pytest.approx(spherical.mss, abs=1e-9)


def test_estimated_noise_is_close_to_the_truth_and_never_far_below():
    _, variances, updates = _updates()
    fitted = NoiseAwareClusterer(2, n_components=None, noise_source="estimate").fit(updates)
    ratio = fitted.estimated_noise_variances_ / variances
    assert ratio.min() > 0.95 and ratio.max() < 1.2


@pytest.mark.parametrize("stacked", [False, True])
def test_the_gram_is_float32_products_summed_in_float64_within_its_rounding(stacked):
    """update_gram's block products run in float32 (the silos' precision, half the time):
    every entry within a few sqrt(w) 2^-24 of ||x_i|| ||x_j|| of the float64 product, far
    below the 1/sqrt(p') of it that the DP noise already puts there, and p' counted alike."""
    _, _, updates = _updates(seed=3, n=30, p=50_000)
    updates[:, :100] = 0.0  # frozen coordinates: not trained
    rows = updates.astype(np.float32)
    exact = rows.astype(np.float64) @ rows.T.astype(np.float64)
    gram, trained = update_gram(StackedRows(list(rows)) if stacked else rows)
    norms = np.sqrt(np.diag(exact))
    error = np.abs(gram - exact) / np.outer(norms, norms)
    width = blocks.column_width(len(rows))
    assert error.max() < 8 * math.sqrt(width) * 2.0**-24 < 0.1 / math.sqrt(trained)
    assert error.max() > 1e-10  # rounded in float32: a float64 product agrees to ~1e-16
    assert trained == 50_000 - 100


def test_an_update_whose_squares_pass_float32s_range_still_gives_the_exact_gram():
    """A silo may send any finite float32 values: one whose products overflow float32 (here
    1e30) must neither turn the Gram matrix infinite nor change the other silos' entries."""
    _, _, updates = _updates(seed=4, n=12, p=5_000)
    rows = updates.astype(np.float32)
    rows[3] *= np.float32(1e30)
    exact = rows.astype(np.float64) @ rows.T.astype(np.float64)
    gram, _ = update_gram(rows)
    norms = np.sqrt(np.diag(exact))
    assert np.isfinite(gram).all()
    assert (np.abs(gram - exact) / np.outer(norms, norms)).max() < 1e-6


def test_projected_noise_is_each_silos_own_variance():
    """In the debiased projection a silo's scatter about its cluster's centre has variance
    v_i on every axis (A13), quiet and noisy silos alike."""
    truth, variances, updates = _updates(seed=1, n=40)
    gram, _ = update_gram(updates)
    points = debiased_projection(gram, variances, 2)
    residual = points - np.stack([np.median(points[truth == t], axis=0) for t in (0, 1)])[truth]
    for level in (1.0, 100.0):
        spread = np.mean(residual[variances == level] ** 2)
        assert 0.5 * level < spread < 2 * level


# --- a silo that under-reports ---------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("liar", [0, 2, 3])
@pytest.mark.parametrize("source", ["larger", "plan"])
@pytest.mark.parametrize("n_clusters", [2, None])
def test_a_silo_reporting_10x_less_noise_moves_no_other_silo(seed, liar, source, n_clusters):
    """Silo ``liar`` reports a noise level (std) 10x below its true one (1/100 of its
    variance). No other silo's assignment changes: the projection takes no report, and the
    liar's own v_i is floored by its estimate over the tolerance (10)."""
    truth, variances, updates = _updates(seed)
    honest = NoiseAwareClusterer(n_clusters, range(2, 6), n_components=None,
                                 noise_source=source).fit(updates, list(variances))
    reported = list(variances)
    reported[liar] = variances[liar] / 100
    lied = NoiseAwareClusterer(n_clusters, range(2, 6), n_components=None,
                               noise_source=source).fit(updates, reported)
    others = np.arange(len(truth)) != liar
    assert _same_partition(honest.labels_, truth)
    assert lied.n_clusters_ == honest.n_clusters_
    assert _same_partition(lied.labels_[others], honest.labels_[others])
    if source == "larger":
        assert lied.noise_variances_[liar] >= lied.estimated_noise_variances_[liar] / 10
        assert lied.noise_variances_[liar] > 0.09 * variances[liar]


def test_noise_sources():
    estimated = np.array([1.0, 2.0, 3.0])
    # larger: the plan unless the estimate over the tolerance exceeds it; no plan: estimate
    np.testing.assert_array_equal(combine_noise([2.0, None, 0.01], estimated, "larger"),
                                  [2.0, 2.0, 0.3])
    np.testing.assert_array_equal(combine_noise([0.5, None, 0.01], estimated, "larger", 1.0),
                                  [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(combine_noise(None, estimated, "estimate"), estimated)
    np.testing.assert_array_equal(combine_noise([5.0, 5.0, 5.0], estimated, "plan"), [5.0] * 3)
    with pytest.raises(ValueError, match="updates \\[1\\] came without one"):
        combine_noise([1.0, None, 1.0], estimated, "plan")


# --- R-DPCFL through the strategy -------------------------------------------------------------
class NoisySilo(ScriptedSilo):
    """A scripted silo whose round-1 update carries DP noise of its own plan: K = 1 full-batch
    step on N = 100 records at noise multiplier ``z``, reported like a real silo reports it."""

    def __init__(self, partition: int, layout: ModelLayout, centres: np.ndarray, z: float,
                 learning_rate: float, clip: float, scale: float = 1.0) -> None:
        super().__init__(partition, layout, centres)
        self.z, self.std = z, learning_rate * z * clip / 100
        self.scale = scale  # what its round-1 update is multiplied by: 1 for an honest silo

    def _train(self, message: Message, cluster: int) -> Message:
        if cluster != INITIAL:
            return super()._train(message, cluster)
        self.received.append(message)
        update = self.scale * (self.centres[TRUTH[self.partition]] + self.rng.normal(
            0, self.std, self.layout.size))
        metrics = {"cluster": cluster, "selected": 0, "num-examples": 100, "val-loss": 1.0,
                   "val-accuracy": 0.5, "epsilon-spent": 1.0, "noise-multiplier": self.z,
                   "batch-size": 100, "steps": 1}
        return self._reply(message, one_record(METRICS, metrics,
                                               {UPDATE: pack(update.astype(np.float32))}))


def _run(clustering: str, source: str = "larger", scales: dict[int, float] | None = None):
    experiment = parse_run_config({
        "clusters": "2,3,3", "rdpcfl.n-clusters": 0, "rdpcfl.max-clusters": 4,
        "rdpcfl.m-choice": "max-mss", "learning-rate": 0.005,  # the mixtures, not M or lr
        "num-server-rounds": 4, "rdpcfl.clustering": clustering,
        "rdpcfl.noise-source": source, "eval-every": 4, "out-dir": "unused"})
    initial = initial_arrays(experiment)
    strategy = ClusteredStrategy(experiment, initial)
    layout = ModelLayout.of(initial)
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 1, (3, layout.size))
    centres *= 0.05 / np.linalg.norm(centres, axis=1, keepdims=True)
    # Odd silos: 10x the noise multiplier of even ones, 100x the noise variance.
    silos = {NODE + p: NoisySilo(p, layout, centres, 1.0 if p % 2 == 0 else 10.0,
                                 experiment.learning_rate, experiment.clip_norm,
                                 (scales or {}).get(p, 1.0))
             for p in range(len(TRUTH))}
    grid = GridDouble(silos)
    strategy.discover(grid, expected=len(TRUTH), wait=1)
    strategy.start(grid, initial, experiment.num_server_rounds, timeout=10)
    return strategy, experiment


def test_rdpcfl_noise_aware_clustering_through_the_strategy(server_task_identity):
    strategy, experiment = _run("noise-aware", "plan")
    outcome = strategy.method.clustering
    labels = np.array(outcome.labels)
    assert outcome.mixture == "noise-aware" and outcome.n_clusters == 3
    assert _same_partition(labels, np.array(TRUTH)[outcome.partitions])
    # v_i = K eta^2 z_i^2 c^2 / N_i^2 from the reported plan.
    eta, c = experiment.learning_rate, experiment.clip_norm
    expected = [(eta * (1.0 if p % 2 == 0 else 10.0) * c / 100) ** 2
                for p in outcome.partitions]
    np.testing.assert_allclose(outcome.noise_variances, expected, rtol=1e-6)
    np.testing.assert_allclose(outcome.estimated_noise_variances, [0.0] * len(expected))
    assert strategy.method.switch == math.floor((1 - outcome.mpo) * 4 / 2)


def test_the_spherical_gmm_clusters_by_noise_and_says_so(server_task_identity, caplog):
    with caplog.at_level(logging.WARNING):
        strategy, _ = _run("spherical")
    # the silos report 100x different noise variances: the operator is told what to use
    assert any("differ 100x" in r.getMessage() and "noise-aware" in r.getMessage()
               for r in caplog.records)
    outcome = strategy.method.clustering
    assert outcome.mixture == "spherical" and outcome.noise_variances is None
    assert not _same_partition(np.array(outcome.labels), np.array(TRUTH)[outcome.partitions])
    strategy, experiment = _run("noise-aware")  # larger of plan and estimate / 10
    outcome = strategy.method.clustering
    assert _same_partition(np.array(outcome.labels), np.array(TRUTH)[outcome.partitions])
    # Every estimate within the tolerance of the plan, so the plan is used; none far below.
    plan = np.array([(experiment.learning_rate * (1.0 if p % 2 == 0 else 10.0)
                      * experiment.clip_norm / 100) ** 2 for p in outcome.partitions])
    np.testing.assert_allclose(outcome.noise_variances, plan, rtol=1e-6)
    assert np.min(np.array(outcome.estimated_noise_variances) / plan) > 0.8


@pytest.mark.parametrize("scale", [1e4, 1e12])
def test_a_silo_whose_update_is_far_off_the_others_loses_round_one_not_the_clustering(
        server_task_identity, caplog, scale):
    """Silo 4 sends its round-1 update times ``scale``, finite float32 values: 1e12 made the
    noise-aware fit overflow and end the run; 1e4 left it its own cluster and the others
    lumped. It loses round 1 (docs/algorithm.md#updates-far-off-the-others); the others are
    clustered as they truly are."""
    with caplog.at_level(logging.ERROR):
        strategy, _ = _run("noise-aware", scales={4: scale})
    outcome = strategy.method.clustering
    assert 4 not in outcome.partitions and len(outcome.partitions) == len(TRUTH) - 1
    assert _same_partition(np.array(outcome.labels), np.array(TRUTH)[outcome.partitions])
    assert strategy.silos[4].dropped_rounds == [1]
    assert all(s.dropped_rounds == [] for p, s in strategy.silos.items() if p != 4)
    [complaint] = [r.getMessage() for r in caplog.records if "median" in r.getMessage()]
    multiple = float(complaint.split("norm is ")[1].split(" times")[0])
    assert complaint.startswith("round 1: silo 4 ") and scale / 10 < multiple < scale * 10


def test_the_fit_refuses_updates_whose_norms_lie_past_what_float64_resolves():
    """Called directly, the noise-aware fit names an update more than 1e6 times the median
    norm (a clear error where it overflowed at ~1e9) and still fits one 1e5 times off."""
    _, _, updates = _updates(seed=1, n=12, p=2_000)
    rows = updates.astype(np.float32)
    median = float(np.median(np.linalg.norm(rows, axis=1)))
    for multiple, refused in ((1e5, False), (1e9, True)):
        far = rows.copy()
        far[7] *= np.float32(multiple * median / np.linalg.norm(rows[7]))
        if refused:
            with pytest.raises(ValueError, match="update 7's norm is 1e\\+09 times"):
                NoiseAwareClusterer(None, range(2, 5)).fit(far)
        else:
            assert NoiseAwareClusterer(None, range(2, 5)).fit(far).labels_.shape == (12,)
