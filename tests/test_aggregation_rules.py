"""Aggregation rules (dpcfl_flwr/aggregation; paper 002 Table 1, §3.4, Table 3):
the RPCA solver, robust-hdp's noise estimates, the Table 3 noise levels, falsified budgets,
and the contract every rule keeps."""

from __future__ import annotations

import math
import os
from functools import cache

import numpy as np
import pytest
from scipy.stats import spearmanr

from dpcfl_flwr.aggregation import (
    RULES,
    RuleSettings,
    UpdateFacts,
    aggregated_noise_level,
    cluster_means,
    combine,
    dp_noise_variance,
    oracle_noise_level,
    principal_component_pursuit,
)
from dpcfl_flwr.config.paper_budgets import DISTRIBUTIONS, PAPER_BATCH_SIZES
from dpcfl_flwr.privacy.calibration import calibrate_noise_multiplier
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS
from dpcfl_flwr.privacy.schedule import single_stage_schedule

P_MNIST = 28_938  # parameters of the paper's MNIST model, the size the server aggregates


# --- 1. the RPCA solver ---------------------------------------------------------------------
def test_pcp_recovers_a_planted_low_rank_plus_sparse_matrix() -> None:
    rng = np.random.default_rng(7)
    low = rng.standard_normal((400, 2)) @ rng.standard_normal((2, 30))
    support = rng.random((400, 30)) < 0.05
    sparse = np.zeros((400, 30))
    sparse[support] = rng.choice([-1.0, 1.0], support.sum()) * rng.uniform(5, 10, support.sum())

    result = principal_component_pursuit(low + sparse)

    assert result.converged and result.residual <= 1e-7
    assert np.linalg.norm(result.low_rank - low) / np.linalg.norm(low) < 0.02
    assert np.linalg.norm(result.sparse - sparse) / np.linalg.norm(sparse) < 0.02
    found = np.abs(result.sparse) > 1.0  # planted entries are >= 5 in magnitude
    assert (found == support).mean() > 0.995
    assert np.linalg.matrix_rank(result.low_rank, tol=1e-3 * np.linalg.norm(low, 2)) == 2


def _reference_pcp(matrix: np.ndarray, tol: float = 1e-7,
                   max_iter: int = 500) -> tuple[np.ndarray, np.ndarray, int]:
    """The inexact ALM as first written: Y itself, a full eigendecomposition of A^T A, the
    whole n x n product for L, soft thresholding by sign and magnitude. The solver's
    rewrite (Y / mu, eigenpairs above the threshold only, the cheaper product order, the
    clip form of the threshold) must give the same split."""
    m = np.asarray(matrix, dtype=np.float64)
    lam = 1.0 / math.sqrt(max(m.shape))
    norm_f = np.linalg.norm(m)
    spectral = math.sqrt(np.linalg.eigvalsh(m.T @ m)[-1])
    mu = 1.25 / spectral
    mu_max = mu * 1e7
    y = m / max(spectral, np.abs(m).max() / lam)
    low, sparse = np.zeros_like(m), np.zeros_like(m)
    for iteration in range(1, max_iter + 1):
        a = m - sparse + y / mu
        values, vectors = np.linalg.eigh(a.T @ a)
        s = np.sqrt(np.clip(values, 0.0, None))
        keep = s > 1.0 / mu
        shrink = (s[keep] - 1.0 / mu) / s[keep]
        low = a @ (vectors[:, keep] * shrink) @ vectors[:, keep].T
        t = m - low + y / mu
        sparse = np.sign(t) * np.maximum(np.abs(t) - lam / mu, 0.0)
        gap = m - low - sparse
        if np.linalg.norm(gap) / norm_f <= tol:
            return low, sparse, iteration
        y = y + mu * gap
        mu = min(mu * 1.2, mu_max)
    return low, sparse, max_iter


@pytest.mark.parametrize(("rows", "columns", "rank"), [(400, 12, 2), (2000, 100, 2)])
def test_pcp_gives_the_split_of_the_plain_inexact_alm(rows, columns, rank) -> None:
    """(2000, 100): the first 9 of 55 iterations keep r < n / 8 singular values, so the
    solver asks LAPACK for those alone, and takes the product in the low-rank order while
    r < n / 2."""
    rng = np.random.default_rng(rows)
    signal = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, columns))
    noise = rng.standard_normal((rows, columns)) * rng.uniform(0.1, 1.0, columns)
    low, sparse, iterations = _reference_pcp(signal + noise)
    result = principal_component_pursuit(signal + noise)
    assert result.converged and result.iterations == iterations
    np.testing.assert_allclose(result.sparse, sparse, rtol=0, atol=1e-9 * np.abs(sparse).max())
    np.testing.assert_allclose(result.low_rank, low, rtol=0, atol=1e-9 * np.abs(low).max())
    np.testing.assert_allclose(np.sum(result.sparse**2, axis=0), np.sum(sparse**2, axis=0),
                               rtol=1e-9)


# --- 2. robust-hdp on synthetic updates with known noise --------------------------------------
def synthetic_updates(seed: int, n: int = 20, p: int = P_MNIST) -> tuple[np.ndarray, np.ndarray]:
    """(n, p) updates = rank-2 shared signal + Gaussian noise whose per-silo variances span
    100x (log-spaced 0.01..1, shuffled); returns (updates, true variances)."""
    rng = np.random.default_rng(seed)
    variances = rng.permutation(np.geomspace(0.01, 1.0, n))
    signal = 0.3 * rng.standard_normal((n, 2)) @ rng.standard_normal((2, p))
    return signal + rng.standard_normal((n, p)) * np.sqrt(variances)[:, None], variances


def facts_for(variances: np.ndarray, claims: np.ndarray) -> list[UpdateFacts]:
    return [UpdateFacts(partition=i, num_train=2400, claimed_epsilon=float(e),
                        noise_variance=float(v))
            for i, (v, e) in enumerate(zip(variances, claims, strict=True))]


@pytest.fixture(scope="module")
def noisy_round() -> tuple[np.ndarray, np.ndarray, list[UpdateFacts]]:
    updates, variances = synthetic_updates(seed=3)
    # Honest claims that fall with the noise, but not as steeply as 1/sigma^2: eps ~ 1/sigma.
    return updates, variances, facts_for(variances, 1.0 / np.sqrt(variances))


def test_robust_hdp_ranks_silos_by_noise_and_lands_near_the_oracle(noisy_round) -> None:
    updates, variances, facts = noisy_round
    rhdp = combine("robust-hdp", updates, facts)
    assert rhdp.fallback is None and rhdp.estimated_variance is not None
    rho = spearmanr(rhdp.weights, 1.0 / variances).statistic
    assert rho > 0.95
    # the estimate is of the right size (up to the common factor the weights ignore)
    assert np.all((rhdp.estimated_variance > 0.5 * variances)
                  & (rhdp.estimated_variance < 3.0 * variances))

    level = aggregated_noise_level(rhdp.weights, variances)
    oracle = oracle_noise_level(variances)
    weiavg = aggregated_noise_level(combine("weiavg", updates, facts).weights, variances)
    uniform = aggregated_noise_level(combine("uniform", updates, facts).weights, variances)
    # spec'd order (paper 002 Table 3: Robust-HDP sits between the oracle and WeiAvg)
    assert oracle <= level < weiavg < uniform
    assert level <= 1.2 * oracle


def test_rpca_rows_are_cut_only_for_clusters_past_the_work_limit() -> None:
    from dpcfl_flwr.aggregation.robust_hdp import rpca_rows
    settings = RuleSettings()
    # the paper's sizes stay whole: the CNN at 20 silos, p' = 200,000 at 20 silos
    assert rpca_rows(20, P_MNIST, settings) == P_MNIST
    assert rpca_rows(20, 11_000_000, settings) == 200_000
    assert rpca_rows(117, P_MNIST, settings) == P_MNIST  # 28,938 x 117^2 < 4e8
    assert rpca_rows(118, P_MNIST, settings) == settings.rpca_auto_rows
    assert rpca_rows(286, P_MNIST, RuleSettings(rpca_work_limit=None)) == P_MNIST
    assert rpca_rows(286, P_MNIST, RuleSettings(rpca_rows=500)) == 500


def test_robust_hdp_on_a_large_cluster_uses_the_first_auto_rows() -> None:
    """Past the work limit the estimate is the exact path's on the first rpca_auto_rows
    coordinates stopped at rpca_auto_tol, nothing else; and the looser stop moves no weight
    by more than 0.1% against the default tolerance's."""
    updates, variances = synthetic_updates(seed=5, n=30, p=4_000)
    facts = facts_for(variances, np.ones(30))
    cut = RuleSettings(rpca_work_limit=1e6, rpca_auto_rows=1_500)
    same = RuleSettings(rpca_work_limit=None, rpca_rows=1_500, rpca_tol=cut.rpca_auto_tol)
    a, b = combine("robust-hdp", updates, facts, cut), combine("robust-hdp", updates, facts, same)
    np.testing.assert_array_equal(a.weights, b.weights)
    tight = combine("robust-hdp", updates, facts, RuleSettings(rpca_work_limit=None,
                                                               rpca_rows=1_500))
    assert not np.array_equal(tight.weights, a.weights)
    np.testing.assert_allclose(a.weights, tight.weights, rtol=1e-3)
    whole = combine("robust-hdp", updates, facts, RuleSettings(rpca_work_limit=None))
    assert not np.array_equal(whole.weights, a.weights)


def test_a_large_cluster_past_the_work_limit_is_decomposed_in_seeded_groups() -> None:
    """Past the work limit a cluster of more than rpca_auto_group silos is split into
    near-equal seeded groups, each silo's estimate is its own group's RPCA, and the weighted
    average's noise stays within 1% (of the oracle's) of the undivided split's: 200 silos
    whose noise variances span 100x, two groups of 100."""
    from dpcfl_flwr.aggregation.robust_hdp import estimate_noise_variances, rpca_groups
    settings = RuleSettings(rpca_work_limit=1e6, rpca_auto_rows=1_500)
    assert [len(g) for g in rpca_groups(250, 4_000, RuleSettings())] == [250]  # under it
    assert sorted(len(g) for g in rpca_groups(250, 4_000, settings)) == [83, 83, 84]
    groups = rpca_groups(200, 4_000, settings)
    assert [len(g) for g in groups] == [100, 100]
    assert sorted(np.concatenate(groups).tolist()) == list(range(200))
    assert [g.tolist() for g in groups] == [g.tolist() for g in rpca_groups(200, 4_000, settings)]
    assert groups[0].tolist() != list(range(100))  # drawn, not the partition order
    other_seed = rpca_groups(200, 4_000, RuleSettings(rpca_work_limit=1e6, seed=1))
    assert [g.tolist() for g in other_seed] != [g.tolist() for g in groups]

    updates, variances = synthetic_updates(seed=9, n=200, p=4_000)
    facts = facts_for(variances, np.ones(200))
    grouped = estimate_noise_variances(updates, settings)
    one_group = RuleSettings(rpca_work_limit=None, rpca_rows=1_500,
                             rpca_tol=settings.rpca_auto_tol)
    for group in groups:
        np.testing.assert_array_equal(grouped[group],
                                      estimate_noise_variances(updates[group], one_group))
    undivided = combine("robust-hdp", updates, facts, RuleSettings(
        rpca_work_limit=1e6, rpca_auto_rows=1_500, rpca_auto_group=200))
    together = combine("robust-hdp", updates, facts, settings)
    oracle = oracle_noise_level(variances)
    excess = aggregated_noise_level(together.weights, variances) / oracle
    assert excess <= aggregated_noise_level(undivided.weights, variances) / oracle + 0.01


def test_a_slow_rpca_says_once_how_to_make_it_cheaper(noisy_round, monkeypatch, caplog) -> None:
    """At hundreds of silos per cluster an RPCA takes a minute; the operator hears once what
    cuts it (rpca-rows), not every round."""
    from dpcfl_flwr.aggregation import robust_hdp
    updates, _, facts = noisy_round
    monkeypatch.setattr(robust_hdp, "SLOW_RPCA_SECONDS", 0.0)
    monkeypatch.setattr(robust_hdp, "_said_slow", False)
    with caplog.at_level("WARNING", logger=robust_hdp.__name__):
        combine("robust-hdp", updates, facts)
        combine("robust-hdp", updates, facts)
    said = [r.getMessage() for r in caplog.records if "rpca-rows" in r.getMessage()]
    assert len(said) == 1 and f"{P_MNIST} x {len(facts)}" in said[0]


# --- 3. paper 002 Table 3 ---------------------------------------------------------------------
# Paper 002 Table 3 (MNIST, n = 20, N_i = 2400, c = 3, E = 1, T = 200, delta = 1e-4, lr = 1):
# per-coordinate variance of the aggregated DP noise, by rule and epsilon distribution.
PAPER_TABLE_3 = {
    "weiavg": (1.02, 1.89, 0.92, 3.22, 4.58, 28.29, 9.85, 48.15, 34.91),
    "dp-fedavg": (1.27, 16.94, 16.28, 26.87, 25.64, 70.71, 18.50, 85.70, 43.20),
    "min-eps": (4.68, 103.91, 103.91, 127.18, 103.91, 1868.45, 74.41, 241.37, 87.15),
    "oracle": (0.27, 0.47, 0.07, 0.64, 0.39, 7.60, 2.25, 13.81, 5.93),
}
# Cells our computation does not meet within 2%, with what we get instead. At epsilon <= 0.17
# the best RDP order sits at the top of the grid and z moves a lot with tiny differences in
# the accountant (z = 211.82 at eps 0.15, b = 64), so the paper's own values cannot be
# recomputed there from its printed settings:
# - dist6 min-eps: eps_min = 0.15, paper 1868.45, ours 1454.03 (-22%);
# - dist6 dp-fedavg: paper 70.71, ours 67.13 (-5%; silo 18 claims 0.15, z = 211.82, and
#   carries most of the uniform average's noise);
# - dist8 min-eps: eps_min = 0.17, paper 241.37, ours 232.47 (-3.7%).
# Every other cell agrees within 2% (plus half a printed digit).
RECOMPUTED_EXCEPTIONS = {
    ("min-eps", "dist6"): 1454.03, ("dp-fedavg", "dist6"): 67.13, ("min-eps", "dist8"): 232.47,
}
# Paper 002's released accountant searches RDP orders 1.1..10.9 and 12..64; ours stops at 63.
# At eps <= 0.2 the best order is the top one, so without 64 z differs (40.42 against the
# authors' 39.84 at eps 0.2, b = 32; 340.84 against 211.82 at eps 0.15, b = 64).
PAPER_ORDERS = (*DEFAULT_ORDERS, 64.0)
N_MNIST, CLIP, DELTA, ROUNDS = 2400, 3.0, 1e-4, 200


@cache
def paper_z(epsilon: float, batch: int) -> float:
    """z as the authors computed it: planning steps T N / b, classic conversion, 2 decimals."""
    schedule = single_stage_schedule(N_MNIST, batch, 1, ROUNDS, exact=False)
    z = calibrate_noise_multiplier(schedule, epsilon, DELTA, "classic", orders=PAPER_ORDERS)
    return round(z, 2)


def paper_variance(epsilon: float, batch: int) -> float:
    """sigma_i^2 of Eq. 7 with lr = 1 over the round's K_i = ceil(N / b) executed steps."""
    return dp_noise_variance(paper_z(epsilon, batch), CLIP, 1.0, batch,
                             math.ceil(N_MNIST / batch))


def table_3_row(dist: str) -> dict[str, float]:
    eps = DISTRIBUTIONS[dist]
    own = [paper_variance(e, b) for e, b in zip(eps, PAPER_BATCH_SIZES, strict=True)]
    at_min = [paper_variance(min(eps), b) for b in PAPER_BATCH_SIZES]
    facts = [UpdateFacts(i, N_MNIST, e, v) for i, (e, v) in enumerate(zip(eps, own, strict=True))]
    dummy = np.zeros((len(eps), 1))

    def level(rule: str, variances: list[float]) -> float:
        return aggregated_noise_level(combine(rule, dummy, facts).weights, variances)

    return {"weiavg": level("weiavg", own), "dp-fedavg": level("samples", own),
            "min-eps": level("min-eps", at_min), "oracle": level("oracle-variance", own)}


@pytest.mark.slow
def test_table_3_noise_levels_match_the_paper() -> None:
    assert paper_z(0.2, 32) == 39.84 and paper_z(0.15, 64) == 211.82
    mismatches = []
    for column, dist in enumerate(sorted(DISTRIBUTIONS)):
        ours = table_3_row(dist)
        for rule, printed in PAPER_TABLE_3.items():
            expected = RECOMPUTED_EXCEPTIONS.get((rule, dist), printed[column])
            tolerance = 0.02 * expected + (0.005 if (rule, dist) not in
                                           RECOMPUTED_EXCEPTIONS else 0.0)
            if abs(ours[rule] - expected) > tolerance:
                mismatches.append(f"{rule} {dist}: ours {ours[rule]:.3f}, expected {expected}")
    assert not mismatches, "\n".join(mismatches)


# --- 4. falsified budgets ---------------------------------------------------------------------
def test_overstated_budgets_inflate_weiavg_but_not_robust_hdp(noisy_round) -> None:
    updates, variances, honest = noisy_round
    claims = np.array([f.claimed_epsilon for f in honest])
    liars = np.argsort(variances)[-3:]  # the three noisiest silos
    claims[liars] *= 10
    lying = facts_for(variances, claims)

    weiavg_honest = aggregated_noise_level(combine("weiavg", updates, honest).weights, variances)
    weiavg_lying = aggregated_noise_level(combine("weiavg", updates, lying).weights, variances)
    assert weiavg_lying > 5 * weiavg_honest

    rhdp_honest = combine("robust-hdp", updates, honest)
    rhdp_lying = combine("robust-hdp", updates, lying)
    np.testing.assert_array_equal(rhdp_honest.weights, rhdp_lying.weights)


# --- 5. the contract of every rule ------------------------------------------------------------
def small_round(n: int = 8, p: int = 3000, seed: int = 5) -> tuple[np.ndarray, list[UpdateFacts]]:
    updates, variances = synthetic_updates(seed, n=n, p=p)
    claims = np.linspace(0.2, 4.0, n)  # distinct: PFA splits them into two groups
    facts = [UpdateFacts(i + 10, 1000 + 250 * i, float(e), float(v))
             for i, (e, v) in enumerate(zip(claims, variances, strict=True))]
    return updates, facts


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_gives_a_probability_vector(rule: str) -> None:
    updates, facts = small_round()
    result = combine(rule, updates, facts)
    assert result.weights.shape == (len(facts),) and result.weights.dtype == np.float64
    assert np.all(result.weights >= 0)
    assert result.weights.sum() == pytest.approx(1.0, abs=1e-12)
    assert result.updates.shape == updates.shape and np.all(np.isfinite(result.updates))
    if rule != "pfa":
        np.testing.assert_array_equal(result.updates, updates)


def test_samples_and_min_eps_weigh_by_record_count() -> None:
    updates, facts = small_round()
    counts = np.array([f.num_train for f in facts], dtype=float)
    for rule in ("samples", "min-eps"):
        np.testing.assert_allclose(combine(rule, updates, facts).weights, counts / counts.sum())
    claims = np.array([f.claimed_epsilon for f in facts])
    np.testing.assert_allclose(combine("weiavg", updates, facts).weights, claims / claims.sum())


def test_pfa_projects_only_the_private_updates() -> None:
    updates, facts = small_round()
    result = combine("pfa", updates, facts)
    assert result.fallback is None
    same = np.all(result.updates == updates, axis=1)
    assert 2 <= same.sum() < len(facts)
    claims = np.array([f.claimed_epsilon for f in facts])
    assert claims[same].min() > claims[~same].max()  # the public ones claim the most
    # in coordinates standardised across the public silos, every projected update lies on
    # the public updates' first principal axis
    public = updates[same]
    mean, scale = public.mean(axis=0), public.std(axis=0)
    axis = np.linalg.svd((public - mean) / scale, full_matrices=False)[2][0]
    projected = (result.updates[~same] - mean) / scale
    singular = np.linalg.svd(projected, compute_uv=False)
    assert singular[1] < 1e-9 * singular[0]
    np.testing.assert_allclose(projected, np.outer(projected @ axis, axis), atol=1e-9)

    flat = [UpdateFacts(f.partition, f.num_train, 1.0, f.noise_variance) for f in facts]
    fallback = combine("pfa", updates, flat)
    assert fallback.fallback is not None and "distinct" in fallback.fallback
    np.testing.assert_array_equal(fallback.updates, updates)


def test_robust_hdp_falls_back_below_min_silos_and_on_a_silent_silo() -> None:
    updates, facts = small_round(n=8)
    few = combine("robust-hdp", updates[:4], facts[:4], RuleSettings(rpca_min_silos=5))
    assert few.fallback is not None and "rpca_min_silos=5" in few.fallback
    np.testing.assert_allclose(few.weights, combine("samples", updates[:4], facts[:4]).weights)

    silent = updates.copy()
    silent[2] = 0.0
    result = combine("robust-hdp", silent, facts)
    assert result.fallback is not None and str(facts[2].partition) in result.fallback
    assert np.all(np.isfinite(result.weights))
    np.testing.assert_allclose(result.weights, combine("samples", silent, facts).weights)


def test_oracle_needs_every_true_variance() -> None:
    updates, facts = small_round()
    facts[3] = UpdateFacts(facts[3].partition, facts[3].num_train, 1.0, None)
    with pytest.raises(ValueError, match=str(facts[3].partition)):
        combine("oracle-variance", updates, facts)
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        combine("fedprox", updates, facts)


def test_dp_noise_variance_is_eq_7() -> None:
    assert dp_noise_variance(2.0, 3.0, 0.1, 32, 75) == pytest.approx(75 * (0.1 * 2 * 3 / 32) ** 2)


def test_cluster_means_moves_only_trained_clusters_by_the_weighted_updates() -> None:
    updates, facts = small_round(n=6, p=50)
    models = [np.full(50, float(m), dtype=np.float32) for m in range(3)]
    assignment = [0, 1, 0, 1, 0, 0]  # nobody trains cluster 2
    contributions = {f.partition: (c, u.astype(np.float32))
                     for f, c, u in zip(facts, assignment, updates, strict=True)}
    by_partition = {f.partition: f for f in facts}

    new, report = cluster_means(models, contributions, by_partition, "samples")

    assert set(report) == {0, 1}
    np.testing.assert_array_equal(new[2], models[2])
    for cluster in (0, 1):
        members = [f for f, c in zip(facts, assignment, strict=True) if c == cluster]
        counts = np.array([f.num_train for f in members], dtype=float)
        weights = counts / counts.sum()
        step = weights @ np.stack([contributions[f.partition][1].astype(np.float64)
                                   for f in members])
        assert new[cluster].dtype == np.float32
        np.testing.assert_array_equal(new[cluster], (models[cluster] + step).astype(np.float32))
        entry = report[cluster]
        assert list(entry.weights) == [f.partition for f in members]
        variances = [f.noise_variance for f in members]
        assert entry.noise_level == pytest.approx(aggregated_noise_level(weights, variances))
        assert entry.oracle_noise_level == pytest.approx(oracle_noise_level(variances))
        assert entry.to_dict()["weights"] == {str(p): w for p, w in entry.weights.items()}


def test_cluster_means_runs_clusters_side_by_side_each_as_alone(monkeypatch) -> None:
    """Clusters aggregate on threads side by side, each on one BLAS thread; every cluster's
    model and report are exactly what its rule gives it alone, in cluster order."""
    import itertools
    import threading

    from threadpoolctl import threadpool_info, threadpool_limits

    from dpcfl_flwr.aggregation import clusters as module

    updates, variances = synthetic_updates(seed=7, n=24, p=3_000)
    facts = facts_for(variances, np.ones(24))
    assignment = np.repeat([2, 0, 1], [10, 8, 6])
    contributions = {f.partition: (int(c), u.astype(np.float32))
                     for f, c, u in zip(facts, assignment, updates, strict=True)}
    models = [np.full(3_000, float(m), dtype=np.float32) for m in range(4)]
    seen: list[tuple[int, int]] = []
    original = module.combine
    side_by_side = (os.cpu_count() or 1) > 1
    # the first two clusters must be under way at once: one after the other, the first would
    # wait here for a second that never comes (however busy the machine, within a minute)
    together = threading.Barrier(2, timeout=60)
    calls = itertools.count()

    def recording(*args, **kwargs):
        seen.append((threading.get_ident(), max(
            lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")))
        if side_by_side and next(calls) < 2:
            together.wait()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "combine", recording)
    with threadpool_limits(2, "blas"):
        new, report = cluster_means(models, contributions, {f.partition: f for f in facts},
                                    "robust-hdp")
    assert {blas for _, blas in seen} == {1}
    if side_by_side:
        assert len({thread for thread, _ in seen}) > 1
    assert list(report) == [0, 1, 2]
    np.testing.assert_array_equal(new[3], models[3])
    for cluster in range(3):
        members = [f for f, c in zip(facts, assignment, strict=True) if c == cluster]
        with threadpool_limits(1, "blas"):
            alone = original("robust-hdp", np.stack([contributions[f.partition][1].astype(
                np.float64) for f in members]), members)
            step = alone.weights @ alone.updates
        np.testing.assert_array_equal(list(report[cluster].weights.values()), alone.weights)
        np.testing.assert_array_equal(
            new[cluster], (models[cluster].astype(np.float64) + step).astype(np.float32))
