"""Writing a file so that a reader never sees half of it, and (``durable``) a crash loses at
most the write under way: the ledger, the checkpoint, the silo's model, results.json."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object], *,
                     durable: bool = True, mode: int | None = None) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it over ``path``.

    ``durable``: fsync the file before and its directory after the rename, so the new content
    survives a power cut once this returns. ``mode``: file permissions (mkstemp's are 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        with contextlib.suppress(OSError):  # platforms without directory fds
            directory = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
