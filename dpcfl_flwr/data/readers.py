"""Readers for the image datasets of the experiments: MNIST, Fashion-MNIST, CIFAR-10.

docs/experiments.md#datasets-and-shifts says where each is found.

torchvision is not available on the target machines, so the files are parsed here with numpy:
the IDX format of MNIST/Fashion-MNIST (gzipped or raw) and the python-pickle batches of
CIFAR-10. Every problem with a file surfaces as a one-line :class:`DataError` naming the file
and what was expected, because these errors end up in the logs of many client processes and a
numpy/gzip/pickle traceback there says nothing about which download is broken.

Loaded arrays are read-only: :func:`load_dataset` caches them and hands the same arrays to
every caller in a process, so an accidental in-place edit must fail instead of silently
changing the data of the next client.
"""

from __future__ import annotations

import functools
import gzip
import logging
import os
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV_VAR = "DPCFL_FASHION_MNIST_DIR"
DATASETS = ("fmnist", "mnist", "cifar10")

_GZIP_MAGIC = b"\x1f\x8b"
# IDX element types (byte 3 of the magic), stored big-endian.
_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_KINDS = {1: "IDX label file", 3: "IDX image file"}
_IDX_STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_IDX_DISPLAY = {"mnist": "MNIST", "fmnist": "Fashion-MNIST"}
# torchvision's download layout (<root>/<Name>/raw/), so an existing download can be reused.
_IDX_TORCH_DIRS = {"mnist": "MNIST", "fmnist": "FashionMNIST"}
_CIFAR_SUBDIR = "cifar-10-batches-py"
_CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST_BATCH = "test_batch"
_CIFAR_SHAPE = (3, 32, 32)


class DataError(Exception):
    """A dataset file or directory is missing or not what it should be (one line of text)."""


def _error(where: str | Path, problem: str) -> DataError:
    """Build the one-line error ``"<where>: <problem>"`` (newlines would split log records)."""
    text = f"{where}: {problem}"
    return DataError(text.replace("\r", " ").replace("\n", " "))


@dataclass(frozen=True, eq=False)
class ImageSet:
    """Images and labels of one official split (train or test) of a dataset.

    ``images`` is uint8 of shape (N, C, H, W) (channel-first, as torch models want it),
    ``labels`` int64 of shape (N,) with values in ``[0, num_classes)``. ``eq=False`` because
    element-wise array comparison has no single truth value; identity is what caching needs.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"ImageSet images must be uint8 of shape (N, C, H, W), got {self.images.dtype} "
                f"of shape {self.images.shape}"
            )
        if self.labels.dtype != np.int64 or self.labels.shape != (len(self.images),):
            raise ValueError(
                f"ImageSet labels must be int64 of shape ({len(self.images)},), got "
                f"{self.labels.dtype} of shape {self.labels.shape}"
            )
        if self.num_classes < 1:
            raise ValueError(f"ImageSet num_classes must be positive, got {self.num_classes}")

    def __len__(self) -> int:
        return len(self.labels)


# --------------------------------------------------------------------------------------------
# IDX (MNIST, Fashion-MNIST)


def _read_bytes(path: Path) -> bytes:
    """The file's content, un-gzipped when it starts with the gzip magic (whatever its suffix)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _error(path, f"cannot read file ({exc.strerror or exc})") from None
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise _error(path, f"corrupt or truncated gzip data ({exc})") from None


def _idx_kind(ndim: int | None) -> tuple[str, str]:
    """How to name the expected file and its magic in errors (uint8, ``ndim`` dimensions)."""
    if ndim is None:
        return "IDX file", "0x000008nn (uint8, nn dimensions)"
    return _IDX_KINDS.get(ndim, f"{ndim}-dimensional IDX file"), f"0x{0x800 + ndim:08x}"


def _parse_idx_header(
    path: Path, data: bytes, ndim: int | None
) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """Element type, shape and payload offset from an IDX header."""
    kind, expected_magic = _idx_kind(ndim)
    if len(data) < 4:
        raise _error(path, f"not an {kind} ({len(data)} bytes, expected magic {expected_magic})")
    magic = int.from_bytes(data[:4], "big")
    valid = data[:2] == b"\x00\x00" and data[2] in _IDX_DTYPES and data[3] > 0
    if not valid or (ndim is not None and data[3] != ndim):
        raise _error(path, f"not an {kind} (magic 0x{magic:08x}, expected {expected_magic})")
    offset = 4 + 4 * data[3]
    if len(data) < offset:
        raise _error(path, f"truncated IDX header ({len(data)} bytes, expected {offset})")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(data[3]))
    return _IDX_DTYPES[data[2]], dims, offset


def read_idx(path: str | Path, ndim: int | None = None) -> np.ndarray:
    """Read one IDX file (gzipped or raw) into a read-only array of the header's shape.

    The IDX magic is two zero bytes, the element type (0x08 = uint8) and the number of
    dimensions; the dimensions follow as big-endian uint32. ``ndim`` (3 for images, 1 for
    labels) makes a file of the wrong kind fail with the magic that was found and expected.
    Gzip is recognised by its magic bytes, not by the file name.
    """
    path = Path(path)
    data = _read_bytes(path)
    dtype, dims, offset = _parse_idx_header(path, data, ndim)
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - offset != expected:
        raise _error(
            path,
            f"IDX payload has {len(data) - offset} bytes, expected {expected} for shape "
            f"{dims} (truncated or wrong file)",
        )
    array = np.frombuffer(data, dtype=dtype, count=expected // dtype.itemsize, offset=offset)
    return array.reshape(dims)


def _idx_search_dirs(directory: Path, name: str) -> list[Path]:
    return [directory, directory / "raw", directory / _IDX_TORCH_DIRS[name] / "raw"]


def _find_idx_file(directory: Path, name: str, stem: str) -> Path:
    """The file for ``stem``, also as ``.gz`` or dotted (``train-images.idx3-ubyte``)."""
    dotted = stem.replace("-idx", ".idx")
    candidates = [stem, f"{stem}.gz", dotted, f"{dotted}.gz"]
    for folder in _idx_search_dirs(directory, name):
        for candidate in candidates:
            if (folder / candidate).is_file():
                return folder / candidate
    raise _error(
        directory,
        f"no {_IDX_DISPLAY[name]} file {stem}[.gz] found (expected the four IDX files of "
        f"{_IDX_DISPLAY[name]}: {', '.join(_IDX_STEMS.values())}, each optionally .gz)",
    )


def _idx_split(directory: Path, name: str, split: str) -> ImageSet:
    """One official split (``"train"`` or ``"test"``) of an IDX dataset, checked for consistency."""
    image_path = _find_idx_file(directory, name, _IDX_STEMS[f"{split}_images"])
    label_path = _find_idx_file(directory, name, _IDX_STEMS[f"{split}_labels"])
    images = read_idx(image_path, ndim=3)
    labels = read_idx(label_path, ndim=1)
    for path, array in ((image_path, images), (label_path, labels)):
        if array.dtype != np.uint8:
            raise _error(path, f"IDX elements are {array.dtype}, expected uint8 (type 0x08)")
    if len(images) != len(labels):
        raise _error(
            label_path, f"{len(labels)} labels for the {len(images)} images of {image_path.name}"
        )
    return _image_set(label_path, images[:, None, :, :], labels, num_classes=10)


def _image_set(source: Path, images: np.ndarray, labels: np.ndarray, num_classes: int) -> ImageSet:
    """An ImageSet with read-only arrays, after checking the labels lie in ``[0, num_classes)``."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise _error(
            source,
            f"labels range over [{labels.min()}, {labels.max()}], expected 0..{num_classes - 1}",
        )
    images = np.ascontiguousarray(images)
    images.setflags(write=False)
    labels.setflags(write=False)
    return ImageSet(images=images, labels=labels, num_classes=num_classes)


def _existing_dir(directory: str | Path, what: str) -> Path:
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise _error(directory, f"no such directory (expected {what})")
    return directory


def load_idx_dataset(directory: str | Path, name: str) -> tuple[ImageSet, ImageSet]:
    """(train, test) of MNIST (``name="mnist"``) or Fashion-MNIST (``name="fmnist"``).

    Looks for the four official IDX files in ``directory`` (also in ``directory/raw`` and in
    torchvision's ``directory/<MNIST|FashionMNIST>/raw``), each optionally gzipped.
    """
    if name not in _IDX_DISPLAY:
        raise _error(name, f"not an IDX dataset (expected one of {', '.join(_IDX_DISPLAY)})")
    directory = _existing_dir(directory, f"the four IDX files of {_IDX_DISPLAY[name]}")
    train = _idx_split(directory, name, "train")
    test = _idx_split(directory, name, "test")
    if train.images.shape[1:] != test.images.shape[1:]:
        raise _error(
            directory,
            f"train images are {train.images.shape[2:]} but test images are "
            f"{test.images.shape[2:]}, expected the same size",
        )
    return train, test


# --------------------------------------------------------------------------------------------
# CIFAR-10


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays: a pickle can run arbitrary code on load, and a
    CIFAR-10 batch needs nothing beyond arrays, lists, dicts and bytes."""

    _ALLOWED = {
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how python 3 writes bytes at pickle protocol 2
    }

    def find_class(self, module: str, name: str) -> Any:
        # The official batches were written by numpy 1.x, whose module was numpy.core.
        if module.startswith("numpy.core."):
            module = "numpy._core." + module.removeprefix("numpy.core.")
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (n, 3, 32, 32) and labels (n,) of one pickled CIFAR-10 batch."""
    try:
        with path.open("rb") as handle:
            batch = _CifarUnpickler(handle, encoding="bytes").load()
    except OSError as exc:
        raise _error(path, f"cannot read file ({exc.strerror or exc})") from None
    except Exception as exc:  # pickle reports corruption through many exception types
        detail = f"{type(exc).__name__}: {exc}"
        raise _error(path, f"not a readable CIFAR-10 pickle batch ({detail})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise _error(path, "not a CIFAR-10 batch (expected a dict with keys b'data' and b'labels')")
    data, labels = batch[b"data"], batch[b"labels"]
    size = int(np.prod(_CIFAR_SHAPE))
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.shape[1:] == (size,)):
        shape = getattr(data, "shape", type(data).__name__)
        raise _error(path, f"b'data' is {shape}, expected a uint8 array of shape (n, {size})")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise _error(path, "b'labels' is not a list of integers") from None
    if labels.shape != (len(data),):
        raise _error(path, f"{labels.size} labels for {len(data)} images, expected one per image")
    # Rows hold the R, G and B planes one after the other, each 32x32 row-major.
    return data.reshape(-1, *_CIFAR_SHAPE), labels


def _cifar_split(folder: Path, batch_names: tuple[str, ...]) -> ImageSet:
    parts = [_load_cifar_batch(folder / name) for name in batch_names]
    images = np.concatenate([images for images, _ in parts])
    labels = np.concatenate([labels for _, labels in parts])
    return _image_set(folder / batch_names[-1], images, labels, num_classes=10)


def _find_cifar_folder(directory: Path) -> Path:
    for folder in (directory, directory / _CIFAR_SUBDIR):
        if (folder / _CIFAR_TEST_BATCH).is_file():
            missing = [n for n in _CIFAR_TRAIN_BATCHES if not (folder / n).is_file()]
            if missing:
                raise _error(folder, f"CIFAR-10 batch {missing[0]} is missing")
            return folder
    raise _error(
        directory,
        f"no CIFAR-10 batches found (expected data_batch_1..5 and test_batch of the python "
        f"version, here or in {_CIFAR_SUBDIR}/)",
    )


def load_cifar10(directory: str | Path) -> tuple[ImageSet, ImageSet]:
    """(train, test) of CIFAR-10 from the python-pickle batches in ``directory``.

    The batches may sit directly in ``directory`` or in ``directory/cifar-10-batches-py``.
    Only pass a directory you trust: although only numpy arrays are rebuilt, pickle is not a
    format meant for untrusted input.
    """
    directory = _existing_dir(directory, "the CIFAR-10 python batches")
    folder = _find_cifar_folder(directory)
    return _cifar_split(folder, _CIFAR_TRAIN_BATCHES), _cifar_split(folder, (_CIFAR_TEST_BATCH,))


# --------------------------------------------------------------------------------------------
# Locating and caching


def find_fashion_mnist() -> Path:
    """The Fashion-MNIST directory: ``$DPCFL_FASHION_MNIST_DIR``, else the Debian package's."""
    configured = os.environ.get(FASHION_MNIST_ENV_VAR)
    if configured:
        path = Path(configured).expanduser()
        if not path.is_dir():
            raise _error(path, f"no such directory (set by {FASHION_MNIST_ENV_VAR})")
        return path
    if FASHION_MNIST_DEBIAN_DIR.is_dir():
        return FASHION_MNIST_DEBIAN_DIR
    raise _error(
        FASHION_MNIST_DEBIAN_DIR,
        f"Fashion-MNIST not found: run `apt-get install dataset-fashion-mnist` or set "
        f"{FASHION_MNIST_ENV_VAR} to a directory holding its four IDX files",
    )


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, directory: str) -> tuple[ImageSet, ImageSet]:
    logger.debug("loading %s from %s", name, directory)
    if name == "cifar10":
        return load_cifar10(directory)
    return load_idx_dataset(directory, name)


def release_cached_datasets() -> None:
    """Forget the datasets :func:`load_dataset` keeps. A deployed silo answers for one
    partition, whose records the silo caches on their own (``silo/silo.py``): the whole
    benchmark it sliced them from (Fashion-MNIST: ~45 MB resident) is dead weight for as long
    as it runs. A later request loads the files again (~0.5 s)."""
    _load_cached.cache_clear()


def load_dataset(name: str, data_dir: str | Path | None) -> tuple[ImageSet, ImageSet]:
    """(train, test) of ``name`` in {"fmnist", "mnist", "cifar10"}, cached per process.

    ``data_dir=None`` auto-detects Fashion-MNIST (see :func:`find_fashion_mnist`); the other
    datasets need an explicit directory. The cache is keyed by the resolved directory, because
    a client process asks for the same dataset once per client it simulates.
    """
    key = name.strip().lower()
    if key not in DATASETS:
        raise _error(name, f"unknown dataset (expected one of {', '.join(DATASETS)})")
    if data_dir is None:
        if key != "fmnist":
            raise _error(key, "no data directory given (only fmnist is found automatically)")
        data_dir = find_fashion_mnist()
    return _load_cached(key, str(Path(data_dir).expanduser().resolve()))
