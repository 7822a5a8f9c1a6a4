"""PLD epsilons kept on disk, for processes of one machine that ask for the same histories.

A PLD epsilon costs 0.1-2 s of CPU (the Gaussian's loss distribution built point by point on
the 1e-4-nat grid, then convolved), and a calibration asks for a dozen of them. Within one
process :func:`.pld._epsilon` remembers them, but a run spreads its silos over processes: a
simulation's Ray workers, a deployment's SuperNodes on one host, the cells of a comparison
grid, and every one of them calibrated the same schedule again. With ``DPCFL_PLD_STORE`` set
to a directory, each figure is computed once and read back by every process that asks for the
same history, delta and grid.

Off unless the variable is set: the directory is trusted as the ledger is. A figure read from
it is what this code computed for that exact history, but whoever may write the directory
could lower a silo's measured spend, so it belongs to the silo's operator alone (never a
directory the server's side can write). docs/privacy.md#pld-accounting.

An entry is a small JSON file named by the SHA-256 of what decides its figure: the history's
canonical key (:func:`.pld.history_key`), delta, the grid, the releases of dp-accounting,
NumPy and SciPy and a digest of the source of :mod:`.pld`, so a figure from other code is
never read. An entry whose
content does not name exactly the request is ignored, and one that cannot be read or written
only costs the computation: the store never fails a figure. Processes that ask for the same
figure at once compose it once: the first claims it (a lock file beside the entry) and the
others wait for its entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..files import write_atomically

#: The environment variable naming the store's directory (unset or empty: no store).
STORE_VARIABLE = "DPCFL_PLD_STORE"
#: Seconds a process waits for another one composing the figure it asks for before it
#: composes the figure itself (one composition: 0.1-2 s here, seconds at the most steps a
#: history may compose by PLD, MAX_COMPOSED).
CLAIM_PATIENCE = 120.0
CLAIM_POLL = 0.02  # seconds between tries of a claimed figure's lock


@functools.cache
def code_version() -> str:
    """What else decides a figure: this package's PLD code and the releases of the libraries
    that compute it (dp-accounting; NumPy and SciPy, whose FFTs convolve)."""
    from . import pld

    source = Path(pld.__file__).read_bytes()
    releases = ", ".join(f"{name} {importlib.metadata.version(name)}"
                         for name in ("dp-accounting", "numpy", "scipy"))
    return f"{releases}, pld.py {hashlib.sha256(source).hexdigest()[:16]}"


def store_directory() -> Path | None:
    """The store named by :data:`STORE_VARIABLE`, or None."""
    named = os.environ.get(STORE_VARIABLE, "")
    return Path(named) if named else None


def remembered(key: object, delta: float, grid: float,
               compute: Callable[[], float]) -> float:
    """The figure of (``key``, ``delta``, ``grid``): read from the store when it holds it,
    else ``compute()``, kept there for the next process. Without a store: ``compute()``."""
    directory = store_directory()
    if directory is None:
        return compute()
    request = {"history": key, "delta": delta, "grid": grid, "code": code_version()}
    text = json.dumps(request, sort_keys=True)
    path = directory / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    as_stored = json.loads(text)  # JSON makes the key's tuples lists: compare in that form
    found = _read(path, as_stored)
    if found is not None:
        return found
    with _claimed(path.with_suffix(".lock")):
        found = _read(path, as_stored)  # composed while this process waited for the claim
        if found is not None:
            return found
        epsilon = compute()
        entry = json.dumps({**request, "epsilon": epsilon}, sort_keys=True).encode()
        with contextlib.suppress(OSError):
            write_atomically(path, lambda handle: handle.write(entry), durable=False)
    return epsilon


@contextlib.contextmanager
def _claimed(lock: Path, patience: float = CLAIM_PATIENCE) -> Iterator[None]:
    """Hold ``lock`` (an exclusive ``flock``) while the block composes a figure, so that
    processes asking for it at the same moment (a deployment's silos all plan round 1 when
    it reaches them) wait for the first one's figure instead of each composing it. The
    kernel lets go of a dead holder's lock; after ``patience`` seconds, or when the lock
    cannot be made, the block runs unclaimed (a second composition, never a wrong figure)."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = lock.open("a")
    except OSError:
        yield
        return
    with handle:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(CLAIM_POLL)
            except OSError:  # a file system without locks: unclaimed
                break
        yield  # closing the handle releases the lock


def _read(path: Path, request: object) -> float | None:
    """The entry's epsilon when it names exactly ``request`` (in its JSON form); None
    otherwise."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict):
        return None
    epsilon = entry.pop("epsilon", None)
    if entry != request:
        return None
    if not isinstance(epsilon, float) or math.isnan(epsilon) or epsilon < 0:
        return None
    return epsilon


__all__ = ["STORE_VARIABLE", "code_version", "remembered", "store_directory"]
