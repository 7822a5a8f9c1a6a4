"""The paper's cluster-structured split of a dataset over clients (docs/experiments.md).

Clients are grouped into M clusters (default {3, 6, 6, 6}, cluster 0 = the minority). Every
client of cluster k sees the same kind of shift:

* ``"rotation"`` (covariate shift, P_i(x) varies): each image is rotated by k*360/M degrees
  counter-clockwise, i.e. 0/90/180/270 degrees for M = 4;
* ``"label_flip"`` (concept shift, P_i(y|x) varies): each label y becomes (y + k) mod C.

The shift applies to the client's train, validation and test data alike. Following the
authors' code [CODE], each client draws int((1 + val_fraction) * N) distinct images from the
official train set (clients may overlap), the first N to train and the rest to validate, and its
own slice of the official test set. Two ways to draw them (``DRAWS``):

* ``"per-client"``: each client's rows come from a generator seeded with (seed, client id), so a
  silo draws its own rows without replaying anyone else's;
* ``"authors"``: the draw of the authors' code, row for row. One legacy NumPy ``RandomState(seed)``
  draws every client's rows in client order (and a second one, seeded alike, the test rows), and
  a client's rows are listed in the order of a Python ``set`` of them, which decides which of them
  train and which validate. With this draw, seed s gives every client the very records the
  authors' code gives it with ``--seed s`` (in their topology {3, 6, 6, 6}, whose test slice of
  |test| // 6 rows is the default here), so a run can be set beside one of theirs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .readers import ImageSet
from .records import Inputs
from .topology import Topology

SHIFTS = ("rotation", "label_flip")
DRAWS = ("per-client", "authors")
_NORMALISATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # [CODE]: MNIST statistics for both MNIST and Fashion-MNIST, 0.5/0.5 for CIFAR-10.
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
# Enough images per grid_sample call to be fast, few enough to bound the sampling grid's memory.
_ROTATION_CHUNK = 4096


@dataclass(frozen=True, eq=False)
class ClientIndices:
    """Which official images a client received: rows of the train set (train, then
    validation) and of the test set. Kept so a split can be audited and reproduced."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


@dataclass(frozen=True, eq=False)
class ClientData:
    """One client's shifted, normalised data, ready for torch.

    ``x_*`` are float32 tensors (n, C, H, W) or records read when used (a silo's own data
    larger than memory: :class:`~.records.LazyRecords`), ``y_*`` int64 tensors (n,).
    ``indices`` records where each row came from (``None`` for data built by hand, e.g. in
    tests).
    """

    client_id: int
    cluster: int
    x_train: Inputs
    y_train: torch.Tensor
    x_val: Inputs
    y_val: torch.Tensor
    x_test: Inputs
    y_test: torch.Tensor
    indices: ClientIndices | None = None

    @property
    def num_train(self) -> int:
        """N_i, the client's number of training samples (what DP-SGD's sampling rate uses)."""
        return len(self.y_train)


def normalisation(dataset: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (mean, std) applied after scaling pixels to [0, 1] [CODE]
    (docs/experiments.md#datasets-and-shifts)."""
    try:
        return _NORMALISATION[dataset]
    except KeyError:
        raise ValueError(
            f"no normalisation for dataset {dataset!r} (expected one of "
            f"{', '.join(_NORMALISATION)})"
        ) from None


def rotation_degrees(cluster: int, num_clusters: int) -> float:
    """k * 360 / M: the counter-clockwise rotation of cluster k's images [CODE]."""
    return cluster * 360.0 / num_clusters


def rotate_images(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate a batch (n, C, H, W) counter-clockwise by ``degrees`` about the image centre.

    Multiples of 90 degrees are exact pixel permutations (``torch.rot90``), which is what
    the paper's 0/90/180/270 setting needs; other angles are bilinear with zero fill.
    """
    quarter_turns = degrees / 90.0
    if math.isclose(quarter_turns, round(quarter_turns), abs_tol=1e-9):
        return torch.rot90(images, round(quarter_turns) % 4, dims=(-2, -1))
    if len(images) == 0:
        return images.clone()
    return torch.cat([_rotate_bilinear(chunk, degrees) for chunk in images.split(_ROTATION_CHUNK)])


def _rotate_bilinear(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Bilinear rotation via an inverse-mapping sampling grid.

    With x to the right and y downwards, an output pixel p shows the input at R p where
    R = [[cos, -sin], [sin, cos]]; in grid_sample's normalised coordinates (each axis spans
    [-1, 1]) the off-diagonal terms pick up the aspect ratio H/W.
    """
    height, width = images.shape[-2:]
    angle = math.radians(degrees)
    cos, sin = math.cos(angle), math.sin(angle)
    theta = torch.tensor(
        [[cos, -sin * height / width, 0.0], [sin * width / height, cos, 0.0]],
        dtype=images.dtype,
    ).expand(len(images), 2, 3)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(
        images, grid, mode="bilinear", padding_mode="zeros", align_corners=False
    )


def flip_labels(labels: torch.Tensor, cluster: int, num_classes: int) -> torch.Tensor:
    """Concept shift of cluster k: y -> (y + k) mod C."""
    return (labels + cluster) % num_classes


def _prepare_images(
    images: np.ndarray, degrees: float, dataset: str
) -> torch.Tensor:
    """uint8 (n, C, H, W) -> rotated, normalised float32 tensor.

    Rotation happens in pixel space ([0, 1]) so that the zero fill of a non-right angle is a
    black background, as for a rotated PIL image, not the normalised value 0.
    """
    mean, std = normalisation(dataset)
    if images.shape[1] != len(mean):
        raise ValueError(
            f"dataset {dataset!r} has {len(mean)} channel(s) but the images have "
            f"{images.shape[1]} (shape {images.shape})"
        )
    pixels = torch.from_numpy(np.array(images, dtype=np.float32)) / 255.0
    if degrees:
        pixels = rotate_images(pixels, degrees)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return ((pixels - mean_t) / std_t).contiguous()


def draw_indices(
    train_size: int, test_size: int, client_id: int, seed: int, samples_per_client: int,
    val_fraction: float = 0.25, test_samples: int | None = None, draw: str = "per-client",
) -> ClientIndices:
    """The rows of the official sets one client gets; depends on (seed, client_id, draw) only.

    The client draws int((1 + val_fraction) * N) distinct train rows (the first N train, the
    rest validate) and then ``test_samples`` distinct test rows (default ``test_size // 6``,
    1666 of 10,000 as in [CODE]; capped at ``test_size``). ``draw`` is one of ``DRAWS``
    (module docstring).
    """
    _check_draw(client_id, seed, samples_per_client, val_fraction, test_samples, draw)
    # The epsilon guards against float noise such as 1.15 * 100 = 114.99999999999999.
    total = int((1.0 + val_fraction) * samples_per_client + 1e-9)
    if total > train_size:
        raise ValueError(
            f"client {client_id} needs {total} distinct training images ({samples_per_client} "
            f"train + {total - samples_per_client} validation) but the training set has only "
            f"{train_size}; lower samples_per_client or val_fraction"
        )
    num_test = min(test_size // 6 if test_samples is None else test_samples, test_size)
    if draw == "authors":
        chosen = _authors_rows(train_size, total, client_id, seed)
        test = _authors_rows(test_size, num_test, client_id, seed)
    else:
        rng = np.random.default_rng([seed, client_id])
        chosen = rng.choice(train_size, size=total, replace=False)
        test = rng.choice(test_size, size=num_test, replace=False)
    return ClientIndices(
        train=chosen[:samples_per_client], val=chosen[samples_per_client:], test=test
    )


#: Every how many clients the authors' replay keeps its generator's state (2.5 kB each).
_REPLAY_STRIDE = 16
#: (size, count, seed) -> the generator's state before clients 0, stride, 2 stride, ...
_REPLAY_STATES: dict[tuple[int, int, int], list[Any]] = {}
_REPLAY_LOCK = threading.Lock()


def _authors_rows(size: int, count: int, client_id: int, seed: int) -> np.ndarray:
    """Client ``client_id``'s ``count`` rows out of ``size`` in the authors' sequential draw.

    One legacy ``RandomState(seed)`` draws ``count`` distinct rows for client 0, then client 1,
    and so on; the client's rows are then listed in the iteration order of a Python set of
    them, as the authors' split does before cutting it into train and validation rows.
    Replaying the earlier clients' draws costs one permutation of ``size`` each (1.1 s for
    client 999 of 60,000 rows), and a simulation reloads a silo's records whenever its
    process's cache has moved on to other silos, so at 1,000 silos every round replayed half
    a million permutations. The replay keeps the generator's state every ``_REPLAY_STRIDE``
    clients, so a client costs at most that many permutations after the first time.
    """
    key = (size, count, seed)
    state = np.random.RandomState(seed)
    with _REPLAY_LOCK:
        kept = _REPLAY_STATES.setdefault(key, [state.get_state()])
        start = min(client_id // _REPLAY_STRIDE, len(kept) - 1)
        state.set_state(kept[start])
        for client in range(start * _REPLAY_STRIDE, client_id):
            state.choice(size, count, replace=False)
            if (client + 1) % _REPLAY_STRIDE == 0 and (client + 1) // _REPLAY_STRIDE == len(kept):
                kept.append(state.get_state())
    rows = state.choice(size, count, replace=False)
    return np.array(list(set(rows.tolist())), dtype=np.int64)


def _check_draw(
    client_id: int, seed: int, samples_per_client: int, val_fraction: float,
    test_samples: int | None, draw: str,
) -> None:
    if draw not in DRAWS:
        raise ValueError(f"unknown draw {draw!r} (expected one of {', '.join(DRAWS)})")
    if draw == "authors" and seed >= 2**32:
        raise ValueError(f"the authors' draw needs a seed below 2**32, got {seed}")
    if client_id < 0:
        raise ValueError(f"client id must be non-negative, got {client_id}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    if samples_per_client < 1:
        raise ValueError(f"samples_per_client must be positive, got {samples_per_client}")
    if not math.isfinite(val_fraction) or val_fraction < 0.0:
        raise ValueError(f"val_fraction must be a non-negative number, got {val_fraction}")
    if test_samples is not None and test_samples < 0:
        raise ValueError(f"test_samples must be non-negative, got {test_samples}")


def _shifted_split(
    source: ImageSet, rows: np.ndarray, cluster: int, num_clusters: int, shift: str,
    dataset: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (x, y) tensors of ``rows`` of ``source`` with cluster ``cluster``'s shift applied."""
    degrees = rotation_degrees(cluster, num_clusters) if shift == "rotation" else 0.0
    x = _prepare_images(source.images[rows], degrees, dataset)
    y = torch.from_numpy(np.array(source.labels[rows], dtype=np.int64))
    if shift == "label_flip":
        y = flip_labels(y, cluster, source.num_classes)
    return x, y


def make_client_data(
    train: ImageSet, test: ImageSet, client_id: int, topology: Topology, shift: str,
    samples_per_client: int, seed: int, val_fraction: float = 0.25,
    test_samples: int | None = None, dataset: str = "fmnist", draw: str = "per-client",
) -> ClientData:
    """Client ``client_id``'s data under ``shift`` in {"rotation", "label_flip"}
    (docs/experiments.md#records-per-client).

    Deterministic from (seed, client_id, draw), so every process can build any client's data
    on its own.
    """
    if shift not in SHIFTS:
        raise ValueError(f"unknown shift {shift!r} (expected one of {', '.join(SHIFTS)})")
    normalisation(dataset)  # fail on an unknown dataset before the sampling work
    cluster = topology.cluster_of(client_id)
    rows = draw_indices(
        len(train), len(test), client_id, seed, samples_per_client, val_fraction, test_samples,
        draw,
    )
    m = topology.num_clusters
    x_train, y_train = _shifted_split(train, rows.train, cluster, m, shift, dataset)
    x_val, y_val = _shifted_split(train, rows.val, cluster, m, shift, dataset)
    x_test, y_test = _shifted_split(test, rows.test, cluster, m, shift, dataset)
    return ClientData(
        client_id=client_id, cluster=cluster, x_train=x_train, y_train=y_train,
        x_val=x_val, y_val=y_val, x_test=x_test, y_test=y_test, indices=rows,
    )
