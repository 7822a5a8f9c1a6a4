"""M against a null of no structure (clustering/model_order.py): structureless federations
give one cluster, clustered ones their number of groups, and the null is the noise each
silo's plan states."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from dpcfl_flwr.clustering import NoiseAwareClusterer, UpdateClusterer
from dpcfl_flwr.clustering.model_order import (
    choose_model_order,
    fit_model_order,
    mean_update,
    noise_variances,
    null_candidate_mss,
    null_columns,
)

P = 4_000
MIXTURES = [UpdateClusterer, NoiseAwareClusterer]


def _federation(groups: tuple[int, ...], separation: float, seed: int,
                variances: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Updates of silos in ``groups``: a shared mean, each group's own offset of norm
    ``separation`` x sqrt(P) (0: no structure), plus N(0, v_i) noise; and the truth."""
    rng = np.random.default_rng(seed)
    truth = np.repeat(np.arange(len(groups)), groups)
    v = np.ones(len(truth)) if variances is None else variances
    offsets = rng.normal(size=(len(groups), P)) * separation
    updates = 3.0 + offsets[truth] + rng.normal(size=(len(truth), P)) * np.sqrt(v)[:, None]
    return updates.astype(np.float32), truth


@pytest.mark.parametrize("mixture", MIXTURES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_silos_without_structure_are_one_cluster(mixture, seed):
    """i.i.d. silos: the authors' rule finds many clusters, the null rule one."""
    updates, _ = _federation((10,), 0.0, seed)
    authors = mixture(None, range(2, 10), random_state=seed, n_components=None)
    authors.fit(updates, [1.0] * 10)
    assert authors.n_clusters_ > 2  # the over-split the null rule is for
    fitted = mixture(None, range(2, 10), random_state=seed, n_components=None)
    order = fit_model_order(fitted, updates, [1.0] * 10, seed=seed)
    assert order.n_clusters == fitted.n_clusters_ == 1
    assert fitted.responsibilities_.shape == (10, 1) and set(fitted.labels_) == {0}
    assert (fitted.mss_, fitted.mpo_) == (0.0, 1.0)


@pytest.mark.parametrize("mixture", MIXTURES)
@pytest.mark.parametrize(("groups", "seed"), [((4, 3, 3), 0), ((3, 6, 6, 6), 1)])
def test_separated_groups_give_their_number(mixture, groups, seed):
    updates, truth = _federation(groups, 0.5, seed)
    fitted = mixture(None, range(2, min(10, len(truth) - 1) + 1), random_state=seed,
                     n_components=None)
    order = fit_model_order(fitted, updates, [1.0] * len(truth), seed=seed)
    assert order.n_clusters == len(groups)
    assert adjusted_rand_score(truth, fitted.labels_) == 1.0
    assert order.evidence[len(groups)] >= 3.0


def test_a_null_federation_is_the_mean_update_plus_each_silos_planned_noise():
    centre = np.linspace(-1.0, 1.0, 20_000)
    variances = np.array([0.25, 1.0, 9.0])
    seen = []

    def record(updates, v):
        seen.append((updates.copy(), v))
        return {2: 1.0}

    null = null_candidate_mss(record, centre, variances, 3, np.random.default_rng(0))
    assert list(null) == [2] and null[2].tolist() == [1.0, 1.0, 1.0]
    for updates, v in seen:
        assert updates.shape == (3, 20_000) and np.array_equal(v, variances)
        spread = (updates - centre).var(axis=1)
        assert np.allclose(spread, variances, rtol=0.05)
        assert np.allclose((updates - centre).mean(axis=1), 0.0, atol=0.05)
    assert not np.array_equal(seen[0][0], seen[1][0])  # fresh noise each draw


def test_unreported_noise_is_estimated_from_the_updates():
    variances = np.array([1.0, 4.0] * 5)
    updates, _ = _federation((10,), 0.0, 3, variances)
    estimated = noise_variances(updates, [None] * 10)
    # the estimate is never far below the truth (the shared mean's part the span misses
    # adds to it): clustering/noise_aware.py
    assert np.all(estimated >= 0.95 * variances) and np.all(estimated <= 1.3 * variances)
    mixed = noise_variances(updates, [2.5, None] + [None] * 8)
    assert mixed[0] == 2.5 and mixed[1] == estimated[1]


def test_null_columns_and_their_mean_are_those_of_the_moved_coordinates():
    updates, _ = _federation((4,), 0.0, 0)
    updates[:, :10] = 0.0  # frozen: no silo moves them
    rng = np.random.default_rng(0)
    columns = null_columns(updates, rng, limit=500)
    assert len(columns) == 500 and columns.min() >= 10 and np.all(np.diff(columns) > 0)
    assert np.allclose(mean_update(updates, columns), updates[:, columns].mean(axis=0))
    assert len(null_columns(updates, rng)) == P - 10


def test_the_choice_weighs_each_candidate_against_its_own_null():
    null = {2: np.array([1.0, 1.1, 0.9, 1.05]), 3: np.array([3.0, 3.3, 2.7, 3.1])}
    # M = 3's MSS is larger, but no larger than noise gives three clusters
    assert choose_model_order({2: 2.0, 3: 3.2}, null).n_clusters == 2
    assert choose_model_order({2: 1.05, 3: 3.2}, null).n_clusters == 1
