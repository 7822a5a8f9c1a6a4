"""Records read when they are used, so a silo whose data is larger than its memory trains with
bounded memory (docs/own-data.md#data-larger-than-memory).

DP-SGD never needs every record at once: a Poisson step draws a mask of rows, the full-batch
round and every evaluation walk the records chunk by chunk. :class:`LazyRecords` answers
exactly those requests (a slice, a boolean mask, an index array) by reading just those rows
from where the records live (a memory-mapped ``.npy`` file, ...), and behaves like the
in-memory float32 tensor it stands for in everything the training code asks of it.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import BinaryIO

import numpy as np
import torch

#: Reads the given rows (sorted or not, numbers of rows where the records live) as a float32
#: array of shape (len(rows), *record_shape).
RowReader = Callable[[np.ndarray], np.ndarray]

#: How many records a pass over all of them reads at once (a chunk of 28x28 images: 12 MB).
PASS_CHUNK = 4096


def fits_in_memory(count: int, record_shape: tuple[int, ...], budget_bytes: int) -> bool:
    """Whether ``count`` float32 records of ``record_shape`` take at most ``budget_bytes``."""
    return count * int(np.prod(record_shape, dtype=np.int64)) * 4 <= budget_bytes


class ByteCache:
    """The most recently used arrays, at most ``capacity`` bytes of them together.

    A lazily read source keeps what it decoded or converted here (an image's pixels, a
    Parquet row group's records), so a pass in order or a record drawn again soon is not
    read twice, while the memory it holds stays under the silo's ``records-memory``. An array
    larger than the whole capacity is returned to its caller and not kept. ``peak`` is the
    most the cache ever held (tests check the bound with it).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity, self.bytes, self.peak = int(capacity), 0, 0
        self._items: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> np.ndarray | None:
        """The array kept under ``key`` (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: np.ndarray) -> None:
        """Keep ``value`` under ``key``, dropping the least recently used arrays to fit."""
        if key in self._items:
            self.bytes -= self._items.pop(key).nbytes
        if value.nbytes > self.capacity:
            return
        while self.bytes + value.nbytes > self.capacity:
            self.bytes -= self._items.popitem(last=False)[1].nbytes
        self._items[key] = value
        self.bytes += value.nbytes
        self.peak = max(self.peak, self.bytes)


class FileRows:
    """Rows of float records in a file, read with positioned reads (``os.preadv``): exactly the
    bytes of the rows asked for, consecutive rows in one read, so a pass in order is a few
    large reads and a Poisson batch one small read a record.

    Why not index a memory map: a page fault on a mapped file reads around it (the device's
    read-ahead, 8 MiB on this machine's disk) whatever the access pattern, so a Poisson batch
    of 1,024 records of 48 KiB read 8 GiB, and a step took seconds once the records no longer
    fit in memory (bench/RESULTS.md). Reads through a descriptor advised as random read no
    more than they are asked.

    ``source``: a path, or an open file the reader keeps (a spool, :func:`spool`);
    ``offset``: bytes before row 0; ``rows``: how many rows the file holds.
    """

    def __init__(self, source: str | BinaryIO, offset: int, dtype: np.dtype,
                 row_shape: tuple[int, ...], rows: int) -> None:
        self.source, self.offset, self.dtype = source, int(offset), np.dtype(dtype)
        self.row_shape, self.rows = tuple(row_shape), int(rows)
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.path = source if isinstance(source, str) else "the silo's spool of records"
        self._descriptor: int | None = None
        if not isinstance(source, str):
            self._descriptor = source.fileno()
            os.posix_fadvise(self._descriptor, 0, 0, os.POSIX_FADV_RANDOM)

    @classmethod
    def of_npy(cls, array: np.memmap) -> FileRows:
        """The rows of a memory-mapped, C-ordered ``.npy`` array, read from its file."""
        if not array.flags.c_contiguous or array.filename is None:
            raise ValueError("FileRows reads C-ordered arrays of a file")
        return cls(str(array.filename), array.offset, array.dtype, tuple(array.shape[1:]),
                   array.shape[0])

    def _file(self) -> int:
        if self._descriptor is None:
            self._descriptor = os.open(str(self.source), os.O_RDONLY)
            os.posix_fadvise(self._descriptor, 0, 0, os.POSIX_FADV_RANDOM)
        return self._descriptor

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return np.empty((0, *self.row_shape), dtype=self.dtype)
        if rows.min() < 0 or rows.max() >= self.rows:
            raise IndexError(f"rows outside 0..{self.rows - 1} of {self.path}")
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        block = np.empty((len(rows), *self.row_shape), dtype=self.dtype)
        runs = np.flatnonzero(np.diff(ordered) != 1) + 1
        descriptor = self._file()
        for start, stop in zip(np.r_[0, runs], np.r_[runs, len(rows)], strict=True):
            self._read_into(descriptor, block[start:stop], int(ordered[start]))
        result = np.empty_like(block)
        result[order] = block
        return result

    def _read_into(self, descriptor: int, target: np.ndarray, first_row: int) -> None:
        view = target.reshape(-1).view(np.uint8).data  # writes through to ``target``
        position = self.offset + first_row * self.row_bytes
        while len(view):
            count = os.preadv(descriptor, [view], position)
            if count == 0:
                raise OSError(f"{self.path}: the file ended before its rows")
            view, position = view[count:], position + count

    def __del__(self) -> None:
        if isinstance(self.source, str) and self._descriptor is not None:
            os.close(self._descriptor)


#: Bytes a spool writes between two flushes to disk (:meth:`Spool.append`).
SPOOL_SYNC_BYTES = 64 * 2**20


class Spool:
    """Records built once and kept on the silo's own disk for reading when used: a temporary
    file, unlinked when made (nothing is left behind, whatever ends the process), of float32
    rows of ``row_shape`` appended block by block. For records that cannot be read at random
    where they are (a Parquet row group or a CSV block holds thousands of them), so a Poisson
    step reads its records and nothing else."""

    def __init__(self, row_shape: tuple[int, ...], directory: str | None = None) -> None:
        self.row_shape, self.rows, self._unsynced = tuple(row_shape), 0, 0
        self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - kept open: read later

    def append(self, block: np.ndarray) -> None:
        """Add rows (float32, (n, *row_shape) or flattened alike) at the end. Every
        :data:`SPOOL_SYNC_BYTES` written are flushed to disk and dropped from the page cache:
        written pages stay dirty until the kernel writes them back, and under a memory cap
        (a container's cgroup) dirty pages it cannot reclaim fast enough get the silo killed."""
        self._file.write(np.ascontiguousarray(block, dtype=np.float32).tobytes())
        self.rows += len(block)
        self._unsynced += block.size * 4
        if self._unsynced >= SPOOL_SYNC_BYTES:
            self._settle()

    def _settle(self) -> None:
        self._file.flush()
        os.fdatasync(self._file.fileno())
        os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self._unsynced = 0

    def reader(self) -> FileRows:
        """The spooled rows (a :data:`RowReader`), once every block is appended."""
        self._settle()
        return FileRows(self._file, 0, np.dtype(np.float32), self.row_shape, self.rows)


class LazyRecords:
    """A split's records (``rows`` of the store ``read`` reads), read on demand.

    Indexing with a slice, a boolean mask or an index array (numpy or torch) returns a float32
    tensor of just those records; ``shape`` and ``len`` are the split's.
    """

    def __init__(self, read: RowReader, rows: np.ndarray, record_shape: tuple[int, ...]
                 ) -> None:
        self._read, self.rows, self.record_shape = read, np.asarray(rows), record_shape

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), *self.record_shape))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: slice | np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(key, torch.Tensor):
            key = key.numpy()
        rows = self.rows[key]
        if len(rows) == 0:
            return torch.zeros((0, *self.record_shape))
        block = np.asarray(self._read(rows), dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(block).reshape(len(rows),
                                                                    *self.record_shape))

    def mapped(self, transform: Callable[[np.ndarray], np.ndarray]) -> LazyRecords:
        """The same records, each block passed through ``transform`` (float32 rows in, rows
        of the same shape out) when read."""
        read = self._read
        return LazyRecords(lambda rows: transform(np.asarray(read(rows), dtype=np.float32)),
                           self.rows, self.record_shape)

    def subset(self, positions: np.ndarray) -> LazyRecords:
        """The records at ``positions`` of this split (a split drawn from all records)."""
        return LazyRecords(self._read, self.rows[positions], self.record_shape)

    def chunks(self, size: int = PASS_CHUNK) -> Iterator[torch.Tensor]:
        """Every record, in order, ``size`` at a time (one pass, bounded memory)."""
        for start in range(0, len(self), size):
            yield self[start:start + size]


#: A split's inputs: in memory, or read when used.
Inputs = torch.Tensor | LazyRecords


def in_memory(x: Inputs) -> torch.Tensor:
    """``x`` as a tensor: itself, or every record read (only for a batch that is needed whole,
    e.g. one chunk of a full-batch step)."""
    return x if isinstance(x, torch.Tensor) else x[:]


def chunks_of(x: Inputs, size: int = PASS_CHUNK) -> Iterator[torch.Tensor]:
    """The records of ``x``, ``size`` at a time."""
    if isinstance(x, LazyRecords):
        yield from x.chunks(size)
    else:
        for start in range(0, x.shape[0], size):
            yield x[start:start + size]
