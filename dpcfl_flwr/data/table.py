"""A silo's own table of records (``data-source = "table"``; docs/own-data.md).

``data-path`` is a CSV file (``.csv``, a header row, comma-separated), a Parquet file
(``.parquet`` or ``.pq``), or a directory of such files read as one table (files in name order,
hidden files ignored, any other file refused). Read with pyarrow.

The federation's schema says what a record is:

- ``features``, in order, become the model's input (float32, the schema's feature width, laid
  out in the schema's input shape when that has more than one axis, e.g. 784 pixel columns
  as ``1,28,28``):
  ``number`` as ``(value - mean) / scale`` (computed in float64), ``category(a|b|c)`` as one
  indicator per listed value, the value compared as text with surrounding spaces trimmed (a
  Parquet number 3 or 3.0 reads as ``3``);
- the label column (``label-column``) holds the schema's class names, or integer labels
  0..C-1 when the schema names none;
- the silo's ``split-column`` (its own node config), if set, gives each record's split
  (``train``, ``val`` or ``test``); otherwise the split is drawn with its ``data-seed``.

A column the schema does not list (nor is the label or split column) is refused, unless the
silo's own ``ignore-columns`` lists it: a file that holds more than the federation expects is
more often a wrong file than a right one, and the silo says which columns it knows to leave
out (an identifier, a column only it uses). A value is missing when it is
null, empty text (after trimming), or NaN in a number column; text such as ``NA`` is not a
missing marker (a CSV is read as text: only an empty field is missing). With ``missing-values =
refuse`` a missing feature value refuses the records; with ``fill`` a missing number becomes
its schema mean (0 once standardised) and a missing category every indicator 0. The fill
values come from the schema only: a value computed from the silo's other records would make
one record's features depend on the others, which per-record DP does not allow for. A
missing label or split value is always refused.

Every problem is one line naming the file and the column, never a record's value: a
refusal's reason reaches the server. Batches of rows (a Parquet row group, a block of CSV)
are converted one at a time by :func:`convert_batch`.

A table whose float32 records fit in the silo's ``records-memory`` is read into tensors when
the silo starts. A larger one, CSV or Parquet, is converted once, batch by batch, into a spool
of float32 records on the silo's own disk (:class:`~.records.Spool`: a temporary file removed
whatever ends the process) and read when used, a step reading just its records: a row group
or a CSV block holds thousands of records, so reading the table itself at random would read
whole groups for every record a Poisson batch draws (a step over 5 GiB of Parquet read it all).
The one conversion refuses exactly what the in-memory reading refuses, before any training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch

from .assembly import class_labels, client_data, lazy_parts, records_memory, split_rows
from .partition import ClientData
from .readers import DataError
from .records import Spool
from .schema import Feature, Schema
from .sources import SPLITS, SourceRequest

logger = logging.getLogger(__name__)

#: Bytes of float64 values one batch of a Parquet table converts at once (a CSV is read in
#: blocks of 1 MiB of text): what converting a table adds to a silo's memory.
BATCH_BYTES = 32 * 2**20

#: File name endings read as tables (compared in lower case), and their format.
TABLE_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True, eq=False)
class Block:
    """A batch of rows built to the schema: ``features`` float32 (rows, feature width),
    ``labels`` int64 (rows,), ``splits`` (rows,) indices of :data:`~.sources.SPLITS`, or
    None when the silo has no split column."""

    features: np.ndarray
    labels: np.ndarray
    splits: np.ndarray | None


@dataclass(frozen=True)
class Rows:
    """Where a batch's rows are: their ``file`` and the table row (1-based, the header not
    counted) of the batch's first row, so that a refusal names the first row at fault. It
    reads as the file's path in a message; the row is for the silo's operator (its log and
    terminal), like every detail of a refusal."""

    file: Path
    first: int = 1

    def __str__(self) -> str:
        return str(self.file)

    def first_of(self, mask: np.ndarray) -> str:
        """`` (row k)``: the first row of the batch where ``mask`` holds."""
        return f" (row {self.first + int(np.argmax(mask))})"


def load_table(request: SourceRequest) -> ClientData:
    """The ``table`` data source: the table at the silo's ``data-path`` (module docstring),
    its features as float32 tensors (n, *input shape), its labels and its split: in memory,
    or (Parquet larger than the silo's ``records-memory``) read when used."""
    schema, path = request.schema, request.path
    split_column = str(request.options.get("split-column") or "")
    ignored = {c.strip() for c in str(request.options.get("ignore-columns") or "").split(",")
               if c.strip()}
    columns = _used_columns(schema, split_column, path, ignored)
    files = _table_files(path)
    budget = records_memory(request)
    features: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    splits: list[np.ndarray] = []
    held, spool = 0, None
    for file in files:
        row = 1
        for batch in _batches(file, columns, len(schema.features), ignored):
            block = convert_batch(batch, schema, split_column, Rows(file, row))
            row += batch.num_rows
            labels.append(block.labels)
            if block.splits is not None:
                splits.append(block.splits)
            if spool is None and held + block.features.nbytes > budget:
                spool = Spool(schema.input_shape)  # larger than memory: kept on disk
                for kept in features:
                    spool.append(kept)
                features.clear()
            if spool is None:
                features.append(block.features)
                held += block.features.nbytes
            else:
                spool.append(block.features)
    if not labels or not sum(len(b) for b in labels):
        raise DataError(f"{path}: the table holds no records")
    label = np.concatenate(labels)
    given = np.concatenate(splits) if split_column else None
    split = split_rows(len(label), given, request, path)
    if spool is not None:
        return client_data(request.client_id,
                           lazy_parts(spool.reader(), label, split, schema.input_shape), path)
    inputs = np.concatenate(features).reshape(-1, *schema.input_shape)
    parts = {name: (torch.from_numpy(inputs[rows]), torch.from_numpy(label[rows]))
             for name, rows in split.items()}
    return client_data(request.client_id, parts, path)


def _used_columns(schema: Schema, split_column: str, path: Path, ignored: set[str]
                  ) -> list[str]:
    """The columns read: the features in order, the label, the split column (if any). A
    column the silo's ``ignore-columns`` lists is never one of them: the silo said it is not
    for training (an identifier, say), whatever a schema says."""
    if not schema.features:
        raise DataError(f"{path}: the table source needs the federation's schema to list the "
                        "features (run-config key features)")
    names = [f.name for f in schema.features]
    for role, column in (("label", schema.label), ("split", split_column)):
        if column and column in names:
            raise DataError(f"{path}: the {role} column {column!r} is also listed as a feature")
    if split_column == schema.label:
        raise DataError(f"{path}: the split column {split_column!r} is the label column")
    used = sorted(ignored & {*names, schema.label})
    if used:
        raise DataError(f"{path}: column {used[0]!r} is in the silo's ignore-columns but the "
                        "schema uses it as a feature or the label")
    return names + [schema.label] + ([split_column] if split_column else [])


def _table_files(path: Path) -> list[Path]:
    """The table's files: ``path`` itself, or a directory's table files by name."""
    if path.is_dir():
        try:
            files = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        except OSError as exc:
            raise DataError(f"{path}: cannot be listed ({exc.strerror})") from None
        if not files:
            raise DataError(f"{path}: no table files (.csv, .parquet) in this directory")
    elif path.exists():
        files = [path]
    else:
        raise DataError(f"{path}: no such file or directory")
    for file in files:
        if not file.is_file() or file.suffix.lower() not in TABLE_SUFFIXES:
            raise DataError(f"{file}: not a table file; the table source reads "
                            f"{', '.join(TABLE_SUFFIXES)} files")
    return files


def _parquet(file: Path, columns: list[str], features: int, ignored: set[str]
             ) -> pq.ParquetFile:
    """``file`` opened as Parquet (its footer read), its columns checked."""
    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(file, "parquet", exc) from None
    _check_columns(parquet.schema_arrow.names, columns, features, ignored, file)
    return parquet


def _batches(file: Path, columns: list[str], features: int, ignored: set[str]
             ) -> Iterator[pa.RecordBatch]:
    """``file``'s rows, a batch at a time (a Parquet row group, a block of CSV), holding only
    ``columns`` (the file's others must be ``ignored``); every column of a CSV is read as text
    (parsed by :func:`convert_batch`, which can then name the column that holds something
    else)."""
    kind = TABLE_SUFFIXES[file.suffix.lower()]
    if kind == "parquet":
        parquet = _parquet(file, columns, features, ignored)
    try:
        if kind == "parquet":  # a row group at a time, in batches of bounded memory
            rows = max(64, BATCH_BYTES // (8 * len(columns)))
            for group in range(parquet.num_row_groups):  # (iter_batches kept every batch
                table = parquet.read_row_group(group, columns=columns)  # it had decoded)
                yield from table.to_batches(max_chunksize=rows)
            return
        with pa_csv.open_csv(file) as header:  # reads the first block only
            _check_columns(header.schema.names, columns, features, ignored, file)
        yield from pa_csv.open_csv(file, convert_options=pa_csv.ConvertOptions(
            include_columns=columns, column_types={c: pa.string() for c in columns}))
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(file, kind, exc) from None


def _unreadable(file: Path, kind: str, exc: Exception) -> DataError:
    """The refusal of a file pyarrow cannot read; pyarrow's text may quote a row of the file,
    so it stays in the silo's own log."""
    logger.warning("%s: %s", file, exc)
    return DataError(f"{file}: not readable as {kind.upper() if kind == 'csv' else 'Parquet'}"
                     f" ({type(exc).__name__}; the silo's log has pyarrow's message)")


def _check_columns(names: list[str], columns: list[str], features: int, ignored: set[str],
                   file: Path) -> None:
    """Refuse a file without a column the schema needs (``columns``: the first ``features``
    are the features, then the label and split columns), with one of them twice, or with a
    column that is neither needed nor ``ignored`` by the silo."""
    missing = [c for c in columns[:features] if c not in names]
    if missing:
        listed = ", ".join(repr(c) for c in missing)
        raise DataError(f"{file}: column{'s' if len(missing) > 1 else ''} {listed} missing; "
                        f"{features - len(missing)} of {features} features")
    for role, column in zip(("label", "split"), columns[features:], strict=False):
        if column not in names:
            raise DataError(f"{file}: {role} column {column!r} missing")
    twice = [c for c in columns if names.count(c) > 1]
    if twice:
        raise DataError(f"{file}: column {twice[0]!r} appears more than once")
    extra = [c for c in names if c not in columns and c not in ignored]
    if extra:
        listed = ", ".join(repr(c) for c in extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise DataError(f"{file}: column{'s' if len(extra) > 1 else ''} {listed} not in the "
                        f"schema ({len(extra)} extra); the silo's ignore-columns lists the "
                        "columns it leaves out")


def convert_batch(batch: pa.RecordBatch, schema: Schema, split_column: str, file: Rows
                  ) -> Block:
    """One batch of ``file``'s rows built to the schema (module docstring): the features in
    the schema's order, the labels and (with a split column) each row's split."""
    features = convert_features(batch, schema, file)
    labels = _labels(batch.column(schema.label), schema, file)
    splits = _splits(batch.column(split_column), split_column, file) if split_column else None
    return Block(features, labels, splits)


def convert_features(batch: pa.RecordBatch, schema: Schema, file: Rows) -> np.ndarray:
    """The features of a batch of ``file``'s rows, float32 (rows, feature width), in the
    schema's order (module docstring)."""
    features = np.empty((batch.num_rows, schema.feature_width), dtype=np.float32)
    start = 0
    for feature in schema.features:
        column = batch.column(feature.name)
        block = (_number(column, feature, schema.missing, file) if feature.kind == "number"
                 else _category(column, feature, schema.missing, file))
        features[:, start:start + feature.width] = block
        start += feature.width
    return features


def _text(column: pa.Array, name: str, file: Rows) -> pa.Array:
    """``column`` as text with surrounding spaces trimmed; empty text becomes null (missing)."""
    try:
        text = pc.utf8_trim_whitespace(pc.cast(column, pa.string()))
    except pa.ArrowException:
        raise DataError(f"{file}: column {name!r} ({column.type}) cannot be read as text"
                        ) from None
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text)


def _refuse_missing(missing: np.ndarray, name: str, rule: str, file: Rows) -> None:
    if rule == "refuse" and missing.any():
        raise DataError(f"{file}: column {name!r} has missing values (null, empty or NaN) and "
                        f"the schema's missing-values rule is refuse{file.first_of(missing)}")


def _number(column: pa.Array, feature: Feature, rule: str, file: Rows) -> np.ndarray:
    """A number feature as ``(value - mean) / scale``, (rows, 1) float32; a missing value
    (refused, or) filled with the schema mean."""
    source = _text(column, feature.name, file) if not (
        pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
        or pa.types.is_boolean(column.type) or pa.types.is_decimal(column.type)) else column
    try:
        values = pc.cast(source, pa.float64()).to_numpy(zero_copy_only=False)
    except pa.ArrowException:
        raise DataError(f"{file}: column {feature.name!r} holds text that is not a number"
                        ) from None
    if np.isinf(values).any():
        raise DataError(f"{file}: column {feature.name!r} holds an infinite number"
                        f"{file.first_of(np.isinf(values))}")
    missing = np.isnan(values)  # a null, once cast, is NaN as well
    _refuse_missing(missing, feature.name, rule, file)
    values = np.where(missing, feature.mean, values)
    return ((values - feature.mean) / feature.scale).astype(np.float32)[:, None]


def _category(column: pa.Array, feature: Feature, rule: str, file: Rows) -> np.ndarray:
    """A category feature as one float32 indicator per listed value, (rows, values); a
    missing value (refused, or) all indicators 0."""
    text = _text(column, feature.name, file)
    index = pc.fill_null(pc.index_in(text, value_set=pa.array(feature.categories)), -1)
    index = index.to_numpy(zero_copy_only=False)
    missing = text.is_null().to_numpy(zero_copy_only=False)
    unknown = (index < 0) & ~missing
    if unknown.any():
        raise DataError(f"{file}: column {feature.name!r} holds a value that is not among the "
                        f"schema's categories{file.first_of(unknown)}")
    _refuse_missing(missing, feature.name, rule, file)
    return (index[:, None] == np.arange(feature.width)[None, :]).astype(np.float32)


def _labels(column: pa.Array, schema: Schema, file: Rows) -> np.ndarray:
    """The label column as labels 0..C-1 (int64), each distinct value resolved once."""
    text = _text(column, schema.label, file)
    if text.null_count:
        absent = text.is_null().to_numpy(zero_copy_only=False)
        raise DataError(f"{file}: label column {schema.label!r} has missing labels (every "
                        f"record needs one){file.first_of(absent)}")
    values = pc.unique(text)
    codes = pc.index_in(text, value_set=values).to_numpy(zero_copy_only=False)
    try:
        labels = class_labels(values.to_pylist(), schema, file.file,
                              f"label column {schema.label!r} holds a label")
    except DataError as exc:
        foreign = np.array([schema.class_index(v) is None for v in values.to_pylist()])
        raise DataError(f"{exc}{file.first_of(foreign[codes])}") from None
    return labels[codes]


def _splits(column: pa.Array, name: str, file: Rows) -> np.ndarray:
    """The split column as indices of SPLITS (int64)."""
    index = pc.index_in(_text(column, name, file), value_set=pa.array(SPLITS))
    if index.null_count:
        other = index.is_null().to_numpy(zero_copy_only=False)
        raise DataError(f"{file}: split column {name!r} holds a value other than "
                        f"{', '.join(SPLITS)} (or none){file.first_of(other)}")
    return index.to_numpy(zero_copy_only=False).astype(np.int64)
