"""The round-1 updates as the clusterings read them: an (n, p) matrix, a block of columns at a
time, in float64 (or float32 where a product needs no more), without ever holding a float64
copy of the whole matrix.

Why blocks of at most ``BLOCK_BYTES``: a large array is mapped afresh by the allocator each
time it is made, and on a virtual machine each fresh page can cost its first touch several
times over (measured at 1,008 silos on this project's 2-core VM: converting the float32
update matrix to float64, 233 MB, took 0.98 s the first time and 0.05 s the next; the
spherical projection 3.8 s from the whole matrix, 1.4 s in 16 MiB blocks, 1.2 s either way
once the memory had been touched). Blocks under glibc's 32 MiB ceiling for mapping an
allocation afresh reuse the last block's memory instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

#: The most bytes of one float64 column block (16 MiB: 2,080 columns at 1,008 silos, the
#: CNN's whole update up to 72 silos).
BLOCK_BYTES = 16 << 20


def column_width(rows: int) -> int:
    """Columns per block for a matrix of ``rows`` rows."""
    return max(1, BLOCK_BYTES // (8 * max(rows, 1)))


def column_blocks(updates: Any, dtype: type = np.float64) -> Iterator[np.ndarray]:
    """Each block of columns of ``updates``, left to right, as ``dtype``: ``updates`` is an
    (n, p) array, a :class:`StackedRows`, or anything with ``.shape`` whose ``[:, a:b]``
    gives that column block (a :class:`StackedRows` makes it in ``dtype`` directly)."""
    n, p = updates.shape
    width = column_width(n)
    for start in range(0, p, width):
        columns = slice(start, start + width)
        block = (updates.block(columns, dtype) if isinstance(updates, StackedRows)
                 else updates[:, columns])
        yield np.asarray(block, dtype=dtype)


class StackedRows:
    """The (n, p) matrix whose rows are ``rows`` (n vectors of p values), without stacking them
    into one array: ``[:, a:b]`` copies that column block alone, as float64. The server's
    round-1 clustering reads the silos' updates through it (a whole stack is 117 MB of
    float32 at 1,008 silos of the CNN)."""

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        lengths = {len(row) for row in rows}
        if len(lengths) > 1:
            raise ValueError(f"rows of different lengths {sorted(lengths)}")
        self._rows = list(rows)
        self.shape = (len(self._rows), lengths.pop() if lengths else 0)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows, columns = index
        return self._block(self._rows[rows], columns, np.float64)

    def block(self, columns: slice, dtype: type) -> np.ndarray:
        """Every row's ``columns``, as one (n, width) array of ``dtype``."""
        return self._block(self._rows, columns, dtype)

    def _block(self, rows: Sequence[np.ndarray], columns: slice, dtype: type) -> np.ndarray:
        width = len(range(*columns.indices(self.shape[1])))
        block: np.ndarray = np.empty((len(rows), width), dtype)
        for i, row in enumerate(rows):
            block[i] = row[columns]
        return block


#: What the clusterings take as the (n, p) updates.
UpdateMatrix = np.ndarray | StackedRows
