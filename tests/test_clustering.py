"""The server's clustering pipeline (docs/algorithm.md#stage-1-clustering-the-round-1-updates)
on synthetic mixtures and on real Fashion-MNIST."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.decomposition import PCA
from sklearn.metrics import adjusted_rand_score
from sklearn.preprocessing import StandardScaler

from dpcfl_flwr.clustering import (
    StackedRows,
    UpdateClusterer,
    blocks,
    overlap,
    project_updates,
    scale_points,
    separation_scores,
    switch_round,
)
from dpcfl_flwr.data import Topology, load_dataset, make_client_data
from dpcfl_flwr.dpsgd.training import DPSGDConfig
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.schedule import two_stage_schedule
from dpcfl_flwr.runs.round_one import round_one_updates


def _mixture(sizes, p, spread, noise, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=spread, size=(len(sizes), p))
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return centres[labels] + rng.normal(scale=noise, size=(len(labels), p)), labels


@pytest.mark.parametrize("block", [1 << 18, 1_000, 7])
@pytest.mark.parametrize("stacked", [False, True])
def test_projection_equals_standardised_pca_applied_to_raw_updates(monkeypatch, block, stacked):
    # columns come in blocks (one, three, and 429 with a ragged last one): each block's
    # standardisation and its share of the projection must add up to the whole, whether the
    # updates are one array or the silos' own vectors read a block at a time
    monkeypatch.setattr(blocks, "BLOCK_BYTES", block * 8 * 15)
    x, _ = _mixture([4, 5, 6], 3_000, 1.0, 0.5)
    x[:, 11] = 0.25  # a constant parameter, which StandardScaler leaves unscaled
    x[:, 2_500] = -7.0
    reference = PCA(n_components=x.shape[0]).fit(StandardScaler().fit_transform(x)).transform(x)
    updates = StackedRows(list(x)) if stacked else x
    for axes in (2, 5):
        np.testing.assert_allclose(np.abs(project_updates(updates, axes)),
                                   np.abs(reference[:, :axes]), rtol=1e-7, atol=1e-8)


def test_stacked_rows_read_like_the_stacked_array():
    rows = [np.arange(10, dtype=np.float32) * i for i in range(3)]
    stacked = StackedRows(rows)
    assert stacked.shape == (3, 10)
    for index in [(slice(None), slice(2, 7)), (slice(1, None), slice(8, 20))]:
        block = stacked[index]
        assert block.dtype == np.float64
        np.testing.assert_array_equal(block, np.stack(rows)[index])
    for dtype in (np.float32, np.float64):  # blocks in the asked type, from rows or an array
        for source in (stacked, np.stack(rows)):
            read = list(blocks.column_blocks(source, dtype))
            assert all(block.dtype == dtype for block in read)
            np.testing.assert_array_equal(np.concatenate(read, axis=1), np.stack(rows))
    with pytest.raises(ValueError, match="different lengths"):
        StackedRows([np.zeros(3), np.zeros(4)])


def test_separation_score_and_overlap_by_hand():
    means = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    radii = np.array([1.0, 0.5, 0.25])
    scores = separation_scores(means, radii)
    assert scores[0, 1] == pytest.approx(5 / 2)  # ||d|| = 5, 2 * max(1, 0.5) = 2
    assert scores[0, 2] == pytest.approx(1 / 2)
    assert scores[1, 2] == pytest.approx(math.hypot(3, 3) / 1.0)
    assert overlap(0.0) == pytest.approx(1.0)
    assert overlap(3.0) == pytest.approx(0.0026998, rel=1e-4)  # 2 Q(3)


@pytest.mark.parametrize(("mpo", "rounds", "expected"), [(0.0, 200, 100), (0.0181, 200, 98),
                                                         (1.0, 200, 0), (0.5, 31, 7)])
def test_switch_round_is_floor_of_one_minus_mpo_times_e_over_2(mpo, rounds, expected):
    assert switch_round(mpo, rounds) == expected


def test_well_separated_mixture_is_recovered_with_high_mss():
    x, labels = _mixture([3, 6, 6], 5_000, 1.0, 0.05)
    fitted = UpdateClusterer(n_clusters=3, random_state=0).fit(x)
    assert adjusted_rand_score(labels, fitted.labels_) == 1.0
    assert fitted.mss_ > 3 and fitted.mpo_ < 0.01
    np.testing.assert_allclose(fitted.responsibilities_.sum(axis=1), 1.0)
    assert fitted.responsibilities_.shape == (15, 3)


def test_unknown_m_is_chosen_by_maximum_mss():
    x, labels = _mixture([5, 6, 6], 2_000, 1.0, 0.05, seed=3)
    fitted = UpdateClusterer(n_clusters=None, random_state=0).fit(x)
    assert fitted.n_clusters_ == 3
    assert fitted.candidate_mss_[3] == max(fitted.candidate_mss_.values())
    assert set(fitted.candidate_mss_) == set(range(2, 11))
    assert adjusted_rand_score(labels, fitted.labels_) == 1.0


def test_overlapping_mixture_has_low_mss():
    x, _ = _mixture([6, 6, 6], 5_000, 0.01, 1.0)
    assert UpdateClusterer(n_clusters=3, random_state=0).fit(x).mss_ < 1.5


def test_scaling_and_degenerate_input():
    points = np.array([[1.0, 10.0], [3.0, 30.0], [2.0, 20.0]])
    np.testing.assert_allclose(scale_points(points), [[0, 0], [1, 1], [0.5, 0.5]])
    with pytest.raises(ValueError, match="fewer than 2 directions"):
        project_updates(np.ones((5, 10)))
    with pytest.raises(ValueError, match="scaler"):
        scale_points(points, "robust")


# --- real data: the paper's Fig. 5 and Fig. 9 (left) on Fashion-MNIST rotations -------------
# (docs/experiments.md#final-paper)
N_PER_CLIENT, ROUNDS, EPSILON, DELTA, LR, CLIP = 2000, 200, 10.0, 1e-4, 0.005, 3.0


def _real_round_one(first_batch):
    train, test = load_dataset("fmnist", None)
    topology = Topology((3, 6, 6, 6))
    clients = [make_client_data(train, test, i, topology, "rotation", N_PER_CLIENT, seed=0,
                                test_samples=1) for i in range(topology.num_clients)]
    truth = [topology.cluster_of(i) for i in range(topology.num_clients)]
    schedule = two_stage_schedule(N_PER_CLIENT, 32, 1, ROUNDS, first_batch)
    # the authors' accounting: their noise level, which the figures show
    z = plan_noise(schedule, EPSILON, DELTA, select_rounds=ROUNDS // 10, conversion="classic",
                   mode="split", accountant="rdp").noise_multiplier
    config = DPSGDConfig(z, CLIP, LR, first_batch)
    updates = round_one_updates(clients, "cnn", config, init_seed=0, noise_seed=1000)
    # The authors' 2-D projection, as in the paper's Fig. 5.
    return UpdateClusterer(n_clusters=4, random_state=0, n_components=2).fit(updates), truth


@pytest.mark.slow
def test_full_batch_round_one_separates_rotation_clusters_but_batch_32_does_not():
    full, truth = _real_round_one("full")
    assert adjusted_rand_score(truth, full.labels_) == 1.0  # exact partition
    assert full.mss_ > 2.0  # RQ5: "an MSS above 2 almost always yields correct detection"
    small, _ = _real_round_one(32)
    assert adjusted_rand_score(truth, small.labels_) < 1.0
    assert small.mss_ < 2.5 and small.mss_ < full.mss_ / 2
    assert small.n_iter_ > full.n_iter_  # Fig. 9 left: EM needs fewer iterations at b1 = N


@pytest.mark.slow
def test_projecting_on_m_minus_1_axes_recovers_clusters_that_2_axes_merge():
    # Quick-example size (N_i = 500, E = 30): four cluster means span 3 dimensions; in 2-D
    # two of them can fall together although the updates keep them apart.
    train, test = load_dataset("fmnist", None)
    topology = Topology((3, 6, 6, 6))
    truth = [topology.cluster_of(i) for i in range(topology.num_clients)]
    z = plan_noise(two_stage_schedule(500, 32, 1, 30), EPSILON, DELTA, 3).noise_multiplier
    two_d, auto = [], []
    for seed in (0, 1, 2):
        clients = [make_client_data(train, test, i, topology, "rotation", 500, seed=seed,
                                    test_samples=1) for i in range(topology.num_clients)]
        updates = round_one_updates(clients, "cnn", DPSGDConfig(z, CLIP, LR, "full"),
                                    init_seed=seed, noise_seed=2000 + seed)
        fitted = {k: UpdateClusterer(4, random_state=seed, n_components=k).fit(updates)
                  for k in (2, None)}
        two_d.append(adjusted_rand_score(truth, fitted[2].labels_))
        auto.append(adjusted_rand_score(truth, fitted[None].labels_))
        assert fitted[None].points_.shape == (21, 3)
        assert fitted[None].mss_ > 2.0
    assert auto == [1.0, 1.0, 1.0]
    assert min(two_d) < 1.0
