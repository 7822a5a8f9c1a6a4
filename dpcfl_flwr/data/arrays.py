"""A silo's own records as arrays: ``x`` (records x the schema's input shape) and ``y`` (integer
class labels), named by the silo's node config (``data-source = "arrays"``, ``data-path``).

Two layouts (docs/own-data.md):

- one ``.npz`` file (``numpy.savez``), or a directory of ``.npy`` files, which are
  memory-mapped rather than read whole;
- either ``x`` and ``y`` (the silo draws its own train / validation / test split with its
  ``data-seed``), or the split given as ``x_train``, ``y_train``, ``x_test``, ``y_test`` and
  optionally ``x_val``, ``y_val``.

Records are taken as they are: no shift, and no normalisation beyond what the silo stored
(constants computed on a silo's records stay on the silo). Every problem is one line
(:class:`~.readers.DataError`) naming the file and what was expected, without counts or values
of the records: a refusal's reason reaches the server. Records of ``.npy`` files stay in
their files and are read when used (:class:`~.records.FileRows`); an ``.npz`` is read into
memory when the silo starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from .assembly import client_data
from .partition import ClientData
from .readers import DataError
from .records import FileRows, Inputs, LazyRecords, chunks_of
from .sources import SPLITS, SourceRequest, draw_split


def _arrays(path: Path) -> Mapping[str, np.ndarray]:
    """The named arrays of ``path`` (an ``.npz`` file or a directory of ``.npy`` files)."""
    if path.is_dir():
        files = {p.stem: p for p in path.glob("*.npy")}
        if not files:
            raise DataError(f"{path}: no .npy files in this directory")
        try:
            return {name: np.load(file, mmap_mode="r", allow_pickle=False)
                    for name, file in files.items()}
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: not readable as .npy arrays ({exc})") from None
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"{path}: not an .npz archive of arrays ({exc})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: a single array; expected an .npz of named arrays (x, y) or "
                        "a directory of .npy files")
    with loaded:
        return {name: loaded[name] for name in loaded.files}


#: A split as arrays: records, labels, and which of their rows it holds (None: all).
_Split = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]


def _split_given(arrays: Mapping[str, np.ndarray], path: Path) -> _Split | None:
    named = {f"{a}_{s}" for a in "xy" for s in SPLITS}
    present = named & set(arrays)
    if not present:
        return None
    needed = {"x_train", "y_train", "x_test", "y_test"}
    if not needed <= present:
        raise DataError(f"{path}: a given split needs x_train, y_train, x_test, y_test; "
                        f"missing {', '.join(sorted(needed - present))}")
    return {s: (arrays[f"x_{s}"], arrays[f"y_{s}"], None) for s in SPLITS
            if f"x_{s}" in arrays}


def _split_drawn(arrays: Mapping[str, np.ndarray], path: Path, seed: int,
                 val_fraction: float, test_fraction: float) -> _Split:
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"{path}: expected arrays x and y (or x_train, y_train, x_test, "
                        f"y_test), found {', '.join(sorted(arrays)) or 'none'}")
    x, y = arrays["x"], arrays["y"]
    _check_pair(x, y, f"{path}")
    parts = draw_split(len(y), seed, val_fraction, test_fraction)
    return {s: (x, y, rows) for s, rows in parts.items()}


def _check_pair(x: np.ndarray, y: np.ndarray, where: str) -> None:
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"{where}: x must be (records, ...) and y (records,) of the same "
                        f"length, got x {x.shape} and y {y.shape}")


def load_arrays(path: str | Path, client_id: int, seed: int, val_fraction: float,
                test_fraction: float) -> ClientData:
    """The silo's records at ``path`` as its train / validation / test split (given, or
    drawn with ``seed``: ``test_fraction`` of the records for test, ``val_fraction`` of the
    rest for validation). Checks the arrays' layout, labels and values, not the schema
    (:func:`check_schema`). Records of ``.npy`` files stay in their files and are read when
    training uses them (:class:`~.records.LazyRecords`); an ``.npz`` is read into memory."""
    path = Path(path)
    arrays = _arrays(path)
    split = _split_given(arrays, path) or _split_drawn(arrays, path, seed, val_fraction,
                                                         test_fraction)
    inputs: dict[str, Inputs] = {}
    labels: dict[str, torch.Tensor] = {}
    for name, (x, y, rows) in split.items():
        where = f"{path} ({name})"
        _check_pair(x, y, where)
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: labels y must be integers, got {y.dtype}")
        chosen = np.arange(len(y)) if rows is None else rows
        reader = (FileRows.of_npy(x) if isinstance(x, np.memmap) and x.flags.c_contiguous
                  else None)
        records = LazyRecords(reader or x.__getitem__, chosen, tuple(x.shape[1:]))
        inputs[name] = records if reader else records[:]  # an .npz: read once, in memory
        if not all(bool(torch.isfinite(chunk).all()) for chunk in chunks_of(inputs[name])):
            raise DataError(f"{where}: records hold NaN or infinite values")
        labels[name] = torch.from_numpy(np.array(y[chosen], dtype=np.int64))
    return client_data(client_id, {name: (inputs[name], labels[name]) for name in inputs}, path)


def load_arrays_source(request: SourceRequest) -> ClientData:
    """The ``arrays`` data source: :func:`load_arrays` on the silo's ``data-path``."""
    return load_arrays(request.path, request.client_id, request.seed, request.val_fraction,
                       request.test_fraction)


def check_schema(data: ClientData, input_shape: tuple[int, ...], num_classes: int,
                 where: str) -> None:
    """Refuse records that do not fit the federation's schema, in one line naming what
    differs. The line reaches the server (the refusal's reason), so it says which part of the
    schema is not met and no statistic of the records: no counts, no values, no label
    histogram."""
    for split in SPLITS:
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        if len(y) == 0:
            continue
        if tuple(x.shape[1:]) != tuple(input_shape):
            raise DataError(f"{where}: {split} records have shape {tuple(x.shape[1:])}, the "
                            f"federation's schema says {tuple(input_shape)}")
        if bool(((y < 0) | (y >= num_classes)).any()):
            raise DataError(f"{where}: {split} labels outside the schema's {num_classes} "
                            f"classes (0..{num_classes - 1})")
