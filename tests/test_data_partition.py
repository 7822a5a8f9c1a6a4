"""The cluster-structured split (docs/experiments.md): topology, sampling, shifts,
normalisation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpcfl_flwr.data.partition import (
    ClientData,
    Topology,
    draw_indices,
    make_client_data,
    normalisation,
    rotate_images,
    rotation_degrees,
)
from dpcfl_flwr.data.readers import ImageSet


def image_set(n: int, channels: int = 1, size: int = 6, seed: int = 0) -> ImageSet:
    """Random images with labels 0..9 (cycled), small enough for fast tests."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, channels, size, size), dtype=np.uint8)
    return ImageSet(images=images, labels=np.arange(n, dtype=np.int64) % 10, num_classes=10)


TRAIN = image_set(20)
TEST = image_set(12, seed=1)
TOPOLOGY = Topology()


def client(
    client_id: int, shift: str = "rotation", seed: int = 0, test_samples: int | None = None
) -> ClientData:
    """A client drawing 16 train + 4 val images, i.e. the whole 20-image TRAIN set."""
    return make_client_data(
        TRAIN, TEST, client_id, TOPOLOGY, shift, 16, seed, test_samples=test_samples
    )


def normalised(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.1307) / 0.3081


# --------------------------------------------------------------------------------------------
# Topology


def test_default_topology_matches_the_authors_code() -> None:
    assert TOPOLOGY.num_clients == 21 and TOPOLOGY.num_clusters == 4
    expected = [0] * 3 + [1] * 6 + [2] * 6 + [3] * 6
    assert [TOPOLOGY.cluster_of(i) for i in range(21)] == expected
    assert TOPOLOGY.members(0) == [0, 1, 2]
    assert TOPOLOGY.members(3) == list(range(15, 21))
    assert TOPOLOGY.minority_cluster() == 0


def test_topology_minority_ties_and_parse() -> None:
    assert Topology((5, 2, 3)).minority_cluster() == 1
    assert Topology((5, 2, 2)).minority_cluster() is None  # no cluster smaller than the rest
    assert Topology((2, 2)).minority_cluster() is None and Topology((4,)).minority_cluster() is None
    assert Topology.parse(" 4, 2 ,7") == Topology((4, 2, 7))
    assert str(Topology.parse("3,6,6,6")) == "3,6,6,6"
    assert Topology([2, 2]).cluster_sizes == (2, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes", [(), (3, 0), (3, -1), (2.5,), (True, 2)])
def test_topology_rejects_bad_sizes(sizes: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="cluster"):
        Topology(sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "3,x", "3,,6", "3;6"])
def test_topology_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="cluster sizes"):
        Topology.parse(text)


def test_topology_range_checks() -> None:
    with pytest.raises(ValueError, match=r"client id 21 is out of range.*0\.\.20"):
        TOPOLOGY.cluster_of(21)
    with pytest.raises(ValueError, match="client id -1"):
        TOPOLOGY.cluster_of(-1)
    with pytest.raises(ValueError, match="cluster 4 is out of range"):
        TOPOLOGY.members(4)


# --------------------------------------------------------------------------------------------
# Sampling


def test_sizes_and_types() -> None:
    data = client(4)
    assert data.client_id == 4 and data.cluster == 1 and data.num_train == 16
    assert data.x_train.shape == (16, 1, 6, 6) and data.x_val.shape == (4, 1, 6, 6)
    assert data.x_test.shape == (2, 1, 6, 6)  # len(TEST) // 6
    splits = [(data.x_train, data.y_train), (data.x_val, data.y_val), (data.x_test, data.y_test)]
    for x, y in splits:
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and len(x) == len(y)


def test_test_samples_explicit_and_capped() -> None:
    assert len(client(0, test_samples=5).y_test) == 5
    assert len(client(0, test_samples=100).y_test) == len(TEST)
    assert draw_indices(60000, 10000, 0, 0, 8000).test.shape == (1666,)


def test_authors_sizes_without_images() -> None:
    rows = draw_indices(60000, 10000, client_id=20, seed=3, samples_per_client=8000)
    assert (len(rows.train), len(rows.val), len(rows.test)) == (8000, 2000, 1666)
    assert len(np.unique(rows.test)) == 1666


def test_train_and_val_are_disjoint_and_distinct() -> None:
    for client_id in range(TOPOLOGY.num_clients):
        rows = draw_indices(1000, 600, client_id, seed=1, samples_per_client=400)
        assert len(rows.train) == 400 and len(rows.val) == 100
        assert len(np.union1d(rows.train, rows.val)) == 500
        assert rows.train.max() < 1000 and rows.test.max() < 600


def _authors_split_by_hand(seed: int, clients: int, train_size: int, test_size: int,
                           per_client: int, num_test: int) -> list[tuple[list, list, list]]:
    """The authors' procedure written out as they describe it: seed NumPy's global generator,
    let every client in turn take a set of distinct rows, list the set, cut at 80%."""
    saved = np.random.get_state()  # the global generator is shared with other tests
    try:
        np.random.seed(seed)
        train_sets = [set(np.random.choice(list(range(train_size)), per_client, replace=False))
                      for _ in range(clients)]
        np.random.seed(seed)
        test_sets = [set(np.random.choice(list(range(test_size)), num_test, replace=False))
                     for _ in range(clients)]
    finally:
        np.random.set_state(saved)
    split = []
    for rows, test in zip(train_sets, test_sets, strict=True):
        listed = list(rows)
        cut = int(0.8 * len(listed))
        split.append((listed[:cut], listed[cut:], list(test)))
    return split


@pytest.mark.parametrize("seed", [0, 3])
def test_authors_draw_is_their_split_row_for_row(seed: int) -> None:
    by_hand = _authors_split_by_hand(seed, 21, 6000, 1000, 625, 166)
    for client_id, (train, val, test) in enumerate(by_hand):
        rows = draw_indices(6000, 1000, client_id, seed, 500, test_samples=166, draw="authors")
        assert rows.train.tolist() == [int(r) for r in train]
        assert rows.val.tolist() == [int(r) for r in val]
        assert rows.test.tolist() == [int(r) for r in test]


def test_authors_draw_row_for_row_in_any_order_past_its_kept_states() -> None:
    """A simulation asks for silos in whatever order its workers get them; the replay keeps
    its generator's state every few clients, and any order gives the authors' rows."""
    by_hand = _authors_split_by_hand(11, 70, 3000, 600, 125, 40)
    order = [69, 3, 40, 16, 15, 0, 68, 33, 47, 32, 31, 17, 50, 69, 1]
    for client_id in order:
        train, val, test = by_hand[client_id]
        rows = draw_indices(3000, 600, client_id, 11, 100, test_samples=40, draw="authors")
        assert rows.train.tolist() == [int(r) for r in train]
        assert rows.val.tolist() == [int(r) for r in val]
        assert rows.test.tolist() == [int(r) for r in test]


def test_authors_draw_differs_from_the_per_client_draw_and_between_clients() -> None:
    ours = draw_indices(60000, 10000, 4, 0, 500)
    theirs = draw_indices(60000, 10000, 4, 0, 500, draw="authors")
    neighbour = draw_indices(60000, 10000, 5, 0, 500, draw="authors")
    assert len(np.intersect1d(ours.train, theirs.train)) < 50
    assert len(np.intersect1d(theirs.train, neighbour.train)) < 50
    assert len(np.union1d(theirs.train, theirs.val)) == 625


def test_val_fraction_rounding() -> None:
    assert len(draw_indices(1000, 60, 0, 0, 100, val_fraction=0.15).val) == 15
    assert len(draw_indices(1000, 60, 0, 0, 100, val_fraction=0.0).val) == 0


def test_deterministic_from_seed_and_client() -> None:
    first, again = client(7, seed=3), client(7, seed=3)
    for name in ["x_train", "y_train", "x_val", "y_val", "x_test", "y_test"]:
        assert torch.equal(getattr(first, name), getattr(again, name))


def test_other_seed_or_client_differs() -> None:
    base = draw_indices(1000, 600, 3, seed=0, samples_per_client=100)
    other_seed = draw_indices(1000, 600, 3, seed=1, samples_per_client=100)
    other_client = draw_indices(1000, 600, 4, seed=0, samples_per_client=100)
    assert not np.array_equal(base.train, other_seed.train)
    assert not np.array_equal(base.train, other_client.train)
    assert not np.array_equal(base.test, other_seed.test)


def test_independent_of_the_other_clients() -> None:
    small = make_client_data(TRAIN, TEST, 2, Topology((3, 1)), "rotation", 16, 0)
    assert torch.equal(small.x_train, client(2).x_train)


# --------------------------------------------------------------------------------------------
# Shifts


def _rows_of(data: ClientData) -> np.ndarray:
    assert data.indices is not None
    return np.concatenate([data.indices.train, data.indices.val])


@pytest.mark.parametrize("client_id", [3, 9, 15])
def test_rotation_is_rot90_of_cluster_zero_image(client_id: int) -> None:
    reference, rotated = client(0), client(client_id)
    k = rotated.cluster
    ref_x = torch.cat([reference.x_train, reference.x_val])
    rot_x = torch.cat([rotated.x_train, rotated.x_val])
    position_in_ref = {int(row): i for i, row in enumerate(_rows_of(reference))}
    for j, row in enumerate(_rows_of(rotated)):  # every index occurs: both drew all 20 images
        expected = torch.rot90(ref_x[position_in_ref[int(row)]], k, dims=(-2, -1))
        assert torch.equal(rot_x[j], expected)
    assert rotated.indices is not None
    expected_test = torch.rot90(normalised(TEST.images[rotated.indices.test]), k, dims=(-2, -1))
    assert torch.equal(rotated.x_test, expected_test)
    assert torch.equal(rotated.y_train, torch.from_numpy(TRAIN.labels[rotated.indices.train]))


def test_cluster_zero_is_unrotated_and_normalised() -> None:
    data = client(1)
    assert data.indices is not None
    assert torch.equal(data.x_train, normalised(TRAIN.images[data.indices.train]))


def test_rotation_is_counter_clockwise() -> None:
    image = torch.zeros(1, 1, 3, 3)
    image[0, 0, 0, 2] = 1.0  # top-right corner
    assert rotate_images(image, 90.0)[0, 0, 0, 0] == 1.0  # moves to top-left
    near = rotate_images(image, 90.0 + 1e-4)  # bilinear path, same direction
    assert torch.allclose(near, rotate_images(image, 90.0), atol=1e-4)


def test_rotation_degrees() -> None:
    assert [rotation_degrees(k, 4) for k in range(4)] == [0.0, 90.0, 180.0, 270.0]
    assert rotation_degrees(1, 8) == 45.0


def test_45_degree_rotation_of_symmetric_blob_keeps_mass() -> None:
    coords = torch.arange(29, dtype=torch.float32) - 14.0
    blob = torch.exp(-(coords[:, None] ** 2 + coords[None, :] ** 2) / (2 * 4.0**2))
    blob = blob.expand(2, 1, 29, 29)
    rotated = rotate_images(blob, 45.0)
    assert rotated.shape == blob.shape
    assert math.isclose(rotated.sum().item(), blob.sum().item(), rel_tol=1e-2)
    assert (rotated - blob).abs().max().item() < 0.02


def test_non_right_angle_through_make_client_data() -> None:
    big = image_set(20, size=28)
    data = make_client_data(big, big, 1, Topology((1, 1, 1)), "rotation", 16, 0)  # 120 degrees
    assert data.cluster == 1 and data.x_train.shape == (16, 1, 28, 28)
    assert torch.isfinite(data.x_train).all()
    # Zero fill happens in pixel space, so filled corners are black after normalisation.
    black = (0.0 - 0.1307) / 0.3081
    assert torch.allclose(data.x_train[:, 0, 0, 0], torch.full((16,), black))


@pytest.mark.parametrize("client_id", [0, 4, 10, 20])
def test_label_flip(client_id: int) -> None:
    data = client(client_id, shift="label_flip")
    assert data.indices is not None
    k = TOPOLOGY.cluster_of(client_id)
    for y, source, rows in [(data.y_train, TRAIN, data.indices.train),
                            (data.y_val, TRAIN, data.indices.val),
                            (data.y_test, TEST, data.indices.test)]:
        assert torch.equal(y, torch.from_numpy((source.labels[rows] + k) % 10))
    assert torch.equal(data.x_train, normalised(TRAIN.images[data.indices.train]))


# --------------------------------------------------------------------------------------------
# Normalisation


def test_normalisation_constants() -> None:
    assert normalisation("mnist") == normalisation("fmnist") == ((0.1307,), (0.3081,))
    assert normalisation("cifar10") == ((0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="svhn"):
        normalisation("svhn")


def test_normalised_pixel_values() -> None:
    images = np.zeros((2, 1, 4, 4), dtype=np.uint8)
    images[1] = 255
    flat = ImageSet(images=images, labels=np.array([0, 1]), num_classes=10)
    data = make_client_data(flat, flat, 0, TOPOLOGY, "rotation", 1, 0, val_fraction=1.0)
    values = torch.cat([data.x_train, data.x_val]).flatten().unique().tolist()
    expected = [(0.0 - 0.1307) / 0.3081, (1.0 - 0.1307) / 0.3081]
    assert values == pytest.approx(expected, rel=1e-6)


def test_cifar_normalisation_maps_to_minus_one_one() -> None:
    colour = image_set(20, channels=3, size=8)
    data = make_client_data(colour, colour, 5, TOPOLOGY, "label_flip", 10, 0, dataset="cifar10")
    assert data.indices is not None
    pixels = torch.from_numpy(colour.images[data.indices.train].astype(np.float32)) / 255.0
    assert torch.allclose(data.x_train, pixels * 2.0 - 1.0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"samples_per_client": 17}, "needs 21 distinct training images"),
    ({"client_id": 21}, "client id 21 is out of range"),
    ({"shift": "blur"}, "unknown shift 'blur'"),
    ({"dataset": "svhn"}, "no normalisation for dataset 'svhn'"),
    ({"dataset": "cifar10"}, "3 channel"),
    ({"seed": -1}, "seed must be a non-negative"),
    ({"samples_per_client": 0}, "samples_per_client must be positive"),
    ({"val_fraction": -0.1}, "val_fraction"),
    ({"test_samples": -1}, "test_samples"),
    ({"draw": "shuffled"}, "unknown draw 'shuffled'"),
    ({"draw": "authors", "seed": 2**32}, "below 2\\*\\*32"),
])
def test_clear_errors(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {
        "train": TRAIN, "test": TEST, "client_id": 0, "topology": TOPOLOGY,
        "shift": "rotation", "samples_per_client": 16, "seed": 0,
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make_client_data(**arguments)  # type: ignore[arg-type]
