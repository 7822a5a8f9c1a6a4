"""Readers of MNIST/Fashion-MNIST (IDX) and CIFAR-10 (pickle batches): round trips and errors."""

from __future__ import annotations

import gzip
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dpcfl_flwr.data import readers
from dpcfl_flwr.data.readers import (
    FASHION_MNIST_DEBIAN_DIR,
    FASHION_MNIST_ENV_VAR,
    DataError,
    find_fashion_mnist,
    load_cifar10,
    load_dataset,
    load_idx_dataset,
    read_idx,
)

STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """An IDX file's content: magic, big-endian uint32 dims, big-endian payload."""
    header = bytes([0, 0, type_code, array.ndim])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, content: bytes, gz: bool = False) -> Path:
    path.write_bytes(gzip.compress(content) if gz else content)
    return path


def assert_one_line_error(excinfo: pytest.ExceptionInfo[DataError], names: str | Path) -> None:
    text = str(excinfo.value)
    assert "\n" not in text and text.strip() == text
    assert str(names) in text
    error = excinfo.value
    assert error.__cause__ is None  # no chained traceback from numpy/gzip/pickle
    assert error.__context__ is None or error.__suppress_context__


def make_idx_dataset(
    directory: Path, n_train: int = 7, n_test: int = 3, gz: bool = True, dotted: bool = False,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny MNIST-like dataset; return the arrays written, keyed by file stem."""
    rng = np.random.default_rng(seed)
    arrays = {
        STEMS[0]: rng.integers(0, 256, (n_train, 5, 4), dtype=np.uint8),
        STEMS[1]: rng.integers(0, 10, n_train, dtype=np.uint8),
        STEMS[2]: rng.integers(0, 256, (n_test, 5, 4), dtype=np.uint8),
        STEMS[3]: rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for stem, array in arrays.items():
        name = stem.replace("-idx", ".idx") if dotted else stem
        write(directory / (name + (".gz" if gz else "")), idx_bytes(array), gz)
    return arrays


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    readers._load_cached.cache_clear()


# --------------------------------------------------------------------------------------------
# read_idx


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("shape", [(6,), (3, 5, 4), (2, 3, 4, 5)])
def test_read_idx_round_trip(tmp_path: Path, gz: bool, shape: tuple[int, ...]) -> None:
    array = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    path = write(tmp_path / ("f.gz" if gz else "f"), idx_bytes(array), gz)
    out = read_idx(path)
    assert out.dtype == np.uint8 and out.shape == shape
    np.testing.assert_array_equal(out, array)
    assert not out.flags.writeable


def test_read_idx_detects_gzip_by_magic_not_suffix(tmp_path: Path) -> None:
    array = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    gz_without_suffix = write(tmp_path / "images", idx_bytes(array), gz=True)
    raw_with_suffix = write(tmp_path / "images.gz", idx_bytes(array), gz=False)
    np.testing.assert_array_equal(read_idx(gz_without_suffix), array)
    np.testing.assert_array_equal(read_idx(raw_with_suffix), array)


def test_read_idx_other_element_types(tmp_path: Path) -> None:
    array = np.array([[-5, 70000], [1, 2]], dtype=np.int32)
    out = read_idx(write(tmp_path / "f", idx_bytes(array, type_code=0x0C)))
    np.testing.assert_array_equal(out, array)


def test_read_idx_wrong_kind_names_magic(tmp_path: Path) -> None:
    labels = write(tmp_path / "train-images-idx3-ubyte.gz", idx_bytes(np.zeros(4, np.uint8)), True)
    with pytest.raises(DataError) as excinfo:
        read_idx(labels, ndim=3)
    assert_one_line_error(excinfo, labels)
    assert "not an IDX image file (magic 0x00000801, expected 0x00000803)" in str(excinfo.value)


def make_dir(path: Path) -> Path:
    path.mkdir()
    return path


GOOD = idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))

CORRUPTIONS: dict[str, Callable[[Path], Path]] = {
    "empty": lambda d: write(d / "f", b""),
    "bad magic": lambda d: write(d / "f", b"\x12\x34" + GOOD[2:]),
    "unknown type code": lambda d: write(d / "f", b"\x00\x00\x07" + GOOD[3:]),
    "zero dims": lambda d: write(d / "f", b"\x00\x00\x08\x00"),
    "truncated header": lambda d: write(d / "f", GOOD[:9]),
    "truncated payload": lambda d: write(d / "f", GOOD[:-1]),
    "trailing bytes": lambda d: write(d / "f", GOOD + b"\x00"),
    "truncated gzip": lambda d: write(d / "f.gz", gzip.compress(GOOD)[:-12]),
    "bad gzip": lambda d: write(d / "f.gz", b"\x1f\x8b\x08\x00" + b"garbage" * 5),
    "gzip bad crc": lambda d: write(
        d / "f.gz", gzip.compress(GOOD)[:-8] + b"\x00" * 4 + gzip.compress(GOOD)[-4:]
    ),
    "directory": lambda d: make_dir(d / "sub"),
    "missing": lambda d: d / "nope",
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_read_idx_corruption_is_one_line_data_error(tmp_path: Path, case: str) -> None:
    path = CORRUPTIONS[case](tmp_path)
    with pytest.raises(DataError) as excinfo:
        read_idx(path)
    assert_one_line_error(excinfo, path)


# --------------------------------------------------------------------------------------------
# load_idx_dataset


@pytest.mark.parametrize(("gz", "dotted"), [(False, False), (True, False), (True, True)])
def test_load_idx_dataset_round_trip(tmp_path: Path, gz: bool, dotted: bool) -> None:
    arrays = make_idx_dataset(tmp_path, gz=gz, dotted=dotted)
    train, test = load_idx_dataset(tmp_path, "mnist")
    assert train.images.shape == (7, 1, 5, 4) and test.images.shape == (3, 1, 5, 4)
    assert train.labels.dtype == np.int64 and train.num_classes == test.num_classes == 10
    np.testing.assert_array_equal(train.images[:, 0], arrays[STEMS[0]])
    np.testing.assert_array_equal(train.labels, arrays[STEMS[1]])
    np.testing.assert_array_equal(test.images[:, 0], arrays[STEMS[2]])
    np.testing.assert_array_equal(test.labels, arrays[STEMS[3]])
    assert not train.images.flags.writeable and not train.labels.flags.writeable


def test_load_idx_dataset_torchvision_layout(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path / "FashionMNIST" / "raw")
    train, _ = load_idx_dataset(tmp_path, "fmnist")
    assert len(train) == 7


def test_load_idx_dataset_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path / "absent", "fmnist")
    assert_one_line_error(excinfo, tmp_path / "absent")
    assert "no such directory" in str(excinfo.value)


def test_load_idx_dataset_missing_file(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path, "fmnist")
    assert_one_line_error(excinfo, tmp_path)
    assert "no Fashion-MNIST file t10k-labels-idx1-ubyte[.gz] found" in str(excinfo.value)


def test_load_idx_dataset_count_mismatch(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    write(labels, idx_bytes(np.zeros(6, np.uint8)), gz=True)
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path, "mnist")
    assert_one_line_error(excinfo, labels)
    assert "6 labels for the 7 images" in str(excinfo.value)


def test_load_idx_dataset_label_out_of_range(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    write(labels, idx_bytes(np.array([0, 10, 3], np.uint8)), gz=True)
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path, "mnist")
    assert_one_line_error(excinfo, labels)
    assert "expected 0..9" in str(excinfo.value)


def test_load_idx_dataset_swapped_files(tmp_path: Path) -> None:
    arrays = make_idx_dataset(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    write(images, idx_bytes(arrays[STEMS[1]]))
    with pytest.raises(DataError) as excinfo:
        load_idx_dataset(tmp_path, "mnist")
    assert_one_line_error(excinfo, images)
    assert "magic 0x00000801, expected 0x00000803" in str(excinfo.value)


def test_load_idx_dataset_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not an IDX dataset"):
        load_idx_dataset(tmp_path, "cifar10")


# --------------------------------------------------------------------------------------------
# CIFAR-10


def make_cifar(folder: Path, per_batch: int = 3, protocol: int = pickle.HIGHEST_PROTOCOL,
               ) -> list[tuple[np.ndarray, list[int]]]:
    """Write the six batches with ``per_batch`` images each; return (data, labels) per batch."""
    rng = np.random.default_rng(7)
    folder.mkdir(parents=True, exist_ok=True)
    batches = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        content = {b"batch_label": name.encode(), b"data": data, b"labels": labels}
        with (folder / name).open("wb") as handle:
            pickle.dump(content, handle, protocol=protocol)
        batches.append((data, labels))
    return batches


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("subdir", [False, True])
def test_load_cifar10_round_trip(tmp_path: Path, protocol: int, subdir: bool) -> None:
    folder = tmp_path / "cifar-10-batches-py" if subdir else tmp_path
    batches = make_cifar(folder, protocol=protocol)
    train, test = load_cifar10(tmp_path)
    assert train.images.shape == (15, 3, 32, 32) and test.images.shape == (3, 3, 32, 32)
    assert train.num_classes == 10 and train.labels.dtype == np.int64
    np.testing.assert_array_equal(train.labels, sum((lab for _, lab in batches[:5]), []))
    np.testing.assert_array_equal(test.labels, batches[5][1])
    row = batches[1][0][2]  # image 2 of data_batch_2 = train image 5
    for channel, r, c in [(0, 0, 0), (1, 3, 17), (2, 31, 30)]:
        assert train.images[5, channel, r, c] == row[channel * 1024 + r * 32 + c]
    np.testing.assert_array_equal(test.images.reshape(3, -1), batches[5][0])


def _pickled(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _Exploit:
    """A pickle that would create a directory when loaded with plain pickle.load."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.target),)


CIFAR_CORRUPTIONS: dict[str, Callable[[Path], bytes]] = {
    "truncated pickle": lambda d: _pickled({b"data": np.zeros((2, 3072), np.uint8)})[:-20],
    "not a pickle": lambda d: b"hello world",
    "not a dict": lambda d: _pickled([1, 2, 3]),
    "missing labels": lambda d: _pickled({b"data": np.zeros((2, 3072), np.uint8)}),
    "wrong width": lambda d: _pickled({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}),
    "wrong dtype": lambda d: _pickled({b"data": np.zeros((2, 3072), np.int16), b"labels": [0, 1]}),
    "label count": lambda d: _pickled({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}),
    "label range": lambda d: _pickled({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 12]}),
    "labels not ints": lambda d: _pickled({b"data": np.zeros((1, 3072), np.uint8),
                                           b"labels": ["cat"]}),
    "code execution": lambda d: _pickled({b"data": _Exploit(d / "pwned"), b"labels": []}),
}


@pytest.mark.parametrize("case", CIFAR_CORRUPTIONS)
def test_load_cifar10_corruption_is_one_line_data_error(tmp_path: Path, case: str) -> None:
    make_cifar(tmp_path)
    bad = tmp_path / "test_batch"
    bad.write_bytes(CIFAR_CORRUPTIONS[case](tmp_path))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, bad)
    assert not (tmp_path / "pwned").exists()


def test_load_cifar10_missing_batch(tmp_path: Path) -> None:
    make_cifar(tmp_path)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, tmp_path)
    assert "data_batch_4 is missing" in str(excinfo.value)


@pytest.mark.parametrize("exists", [False, True])
def test_load_cifar10_missing_directory_or_files(tmp_path: Path, exists: bool) -> None:
    directory = tmp_path if exists else tmp_path / "absent"
    with pytest.raises(DataError) as excinfo:
        load_cifar10(directory)
    assert_one_line_error(excinfo, directory)


# --------------------------------------------------------------------------------------------
# locating and caching


def test_find_fashion_mnist_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FASHION_MNIST_ENV_VAR, str(tmp_path))
    assert find_fashion_mnist() == tmp_path
    monkeypatch.setenv(FASHION_MNIST_ENV_VAR, str(tmp_path / "absent"))
    with pytest.raises(DataError) as excinfo:
        find_fashion_mnist()
    assert_one_line_error(excinfo, tmp_path / "absent")
    assert FASHION_MNIST_ENV_VAR in str(excinfo.value)


def test_find_fashion_mnist_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FASHION_MNIST_ENV_VAR, raising=False)
    monkeypatch.setattr(readers, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "absent")
    with pytest.raises(DataError) as excinfo:
        find_fashion_mnist()
    assert_one_line_error(excinfo, tmp_path / "absent")
    assert "apt-get install dataset-fashion-mnist" in str(excinfo.value)
    assert FASHION_MNIST_ENV_VAR in str(excinfo.value)


def test_load_dataset_caches_per_resolved_directory(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path / "mnist")
    first = load_dataset("mnist", tmp_path / "mnist")
    assert load_dataset("MNIST", f"{tmp_path}/./mnist/") is first
    make_cifar(tmp_path / "cifar")
    assert load_dataset("cifar10", str(tmp_path / "cifar"))[0].images.shape[1] == 3
    # a deployed silo releases them once its records are cached: read again, same content
    readers.release_cached_datasets()
    again = load_dataset("mnist", tmp_path / "mnist")
    assert again is not first
    np.testing.assert_array_equal(again[0].images, first[0].images)


def test_load_dataset_auto_detects_fmnist_via_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_idx_dataset(tmp_path, n_train=4)
    monkeypatch.setenv(FASHION_MNIST_ENV_VAR, str(tmp_path))
    assert len(load_dataset("fmnist", None)[0]) == 4


@pytest.mark.parametrize(("name", "data_dir", "message"), [
    ("svhn", "/tmp", "unknown dataset"),
    ("mnist", None, "no data directory given"),
    ("cifar10", None, "no data directory given"),
])
def test_load_dataset_bad_arguments(name: str, data_dir: str | None, message: str) -> None:
    with pytest.raises(DataError, match=message) as excinfo:
        load_dataset(name, data_dir)
    assert "\n" not in str(excinfo.value)


def test_real_debian_fashion_mnist() -> None:
    if not FASHION_MNIST_DEBIAN_DIR.is_dir():
        pytest.fail(
            f"{FASHION_MNIST_DEBIAN_DIR} is missing: run `apt-get install dataset-fashion-mnist`"
        )
    train, test = load_idx_dataset(FASHION_MNIST_DEBIAN_DIR, "fmnist")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.num_classes == test.num_classes == 10
    # Fashion-MNIST is balanced: 6000 train and 1000 test images per class.
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
