"""Assembling a silo's records: the steps every data source shares when it builds them to the
federation's schema (docs/own-data.md).

- class names to labels, through :meth:`~.schema.Schema.class_index` (an image folder's class
  folders, a table's label column);
- the silo's train / validation / test split, given by the records (split folders, a split
  column) or drawn on the silo with its seed (:func:`~.sources.draw_split`);
- the :class:`~.partition.ClientData` made of the split tensors, with the rule every source
  shares (at least 2 training records);
- whether the records are built in memory or read when used: the silo's ``records-memory``
  bounds what its records may take (docs/own-data.md#data-larger-than-memory).

Errors are one :class:`~.readers.DataError` line naming where the problem is and what the
schema expects, never a record's value: a refusal's reason reaches the server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from .partition import ClientData
from .readers import DataError
from .records import Inputs, LazyRecords, RowReader
from .schema import Schema
from .sources import RECORDS_MEMORY_MIB, SPLITS, SourceRequest, check_training_records, draw_split


def expected_classes(schema: Schema) -> str:
    """The schema's classes as an error message states them: ``class-names a, b`` or
    ``0..C-1``."""
    if schema.class_names:
        return f"class-names {', '.join(schema.class_names)}"
    return f"0..{schema.num_classes - 1}"


def class_labels(names: Sequence[str], schema: Schema, where: str | Path, what: str
                 ) -> np.ndarray:
    """The labels (int64) of class ``names``: a schema's class name, or an integer label
    0..C-1 when the schema names no classes. A name that is neither is refused with the line
    ``"<where>: <what> not one of the schema's classes (...)"``; the name itself is not
    quoted, as it may be a record's value."""
    labels = [schema.class_index(name) for name in names]
    if any(label is None for label in labels):
        raise DataError(f"{where}: {what} not one of the schema's classes "
                        f"({expected_classes(schema)})")
    return np.array(labels, dtype=np.int64)


def split_rows(count: int, given: np.ndarray | None, request: SourceRequest,
               where: str | Path) -> dict[str, np.ndarray]:
    """Which of records 0..count-1 train, validate and test.

    ``given``: each record's split as an index into :data:`~.sources.SPLITS` (from split
    folders or a split column), of which train and test must hold records; None: drawn with
    the silo's ``data-seed`` and fractions, as every source draws it."""
    if given is None:
        return draw_split(count, request.seed, request.val_fraction, request.test_fraction)
    rows = {split: np.flatnonzero(given == index) for index, split in enumerate(SPLITS)}
    if not len(rows["test"]):
        raise DataError(f"{where}: the given split has no test records (a given split needs "
                        "train and test records; validation is optional)")
    return rows


def records_memory(request: SourceRequest) -> int:
    """The bytes the silo's records may take in memory (its ``records-memory``, MiB)."""
    return int(request.options.get("records-memory") or RECORDS_MEMORY_MIB) * 2**20


def lazy_parts(read: RowReader, labels: np.ndarray, split: Mapping[str, np.ndarray],
               record_shape: tuple[int, ...]) -> dict[str, tuple[Inputs, torch.Tensor]]:
    """Each split's records read when used by ``read`` (rows of all the records, which
    ``labels`` label), with its labels."""
    return {name: (LazyRecords(read, rows, record_shape), torch.from_numpy(labels[rows]))
            for name, rows in split.items()}


def client_data(client_id: int, parts: Mapping[str, tuple[Inputs, torch.Tensor]],
                where: str | Path) -> ClientData:
    """A silo's records from its splits' ``(x, y)`` tensors (validation may be absent:
    empty), refused if fewer than 2 train. The silo's group is unknown (cluster -1)."""
    x_train, y_train = parts["train"]
    x_val, y_val = parts.get("val", (x_train[:0], y_train[:0]))
    x_test, y_test = parts["test"]
    return check_training_records(
        ClientData(client_id, -1, x_train, y_train, x_val, y_val, x_test, y_test), where)
