"""Freed heap memory handed back to the operating system after each of a deployed silo's
messages.

A silo's round takes memory it frees before it replies: the full-batch round (the
per-sample gradients and activations of a chunk of up to 512 records) and the privacy
accountant's compositions. glibc's ``malloc`` keeps freed memory for reuse rather than
return it, so a silo process held its largest round's memory for the rest of its life: on
the quick example, a silo's resident memory stayed ~150 MB above what it held between
rounds, and 21 silos on one machine held 21 such peaks. ``malloc_trim(0)`` returns the free
pages of every heap. It takes a few milliseconds, once per message, and is called only
outside simulation (there one process serves every silo, one message after another).

The silo's reply need not wait for it: where the reply's sender says so (a warm ClientApp's
runtime, :func:`reply_first`), :func:`after_reply` holds the work until the reply has left.
On a machine whose cores the silos share, the trim otherwise held each reply a little longer
(5-9 ms of CPU per message on the quick example, in a thread that yields to the others).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def give_back_freed_memory() -> bool:
    """Return the free pages of the process' heaps to the system; whether any were
    (False too where the C library cannot)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


_replying = threading.local()  # .waiting: the work held until this thread's reply has left


def after_reply(work: Callable[[], object]) -> None:
    """Run ``work`` once the reply to the message this thread answers has left, if its
    sender holds work until then (:func:`reply_first`); else now."""
    waiting = getattr(_replying, "waiting", None)
    if waiting is None:
        work()
    else:
        waiting.append(work)


@contextlib.contextmanager
def reply_first() -> Iterator[None]:
    """The work that :func:`after_reply` is given inside the block runs as the block ends
    (the reply's sender ends it once the reply has left), even if the block fails; work that
    fails is logged, not raised (clean-up must not stop the runtime that sends replies)."""
    outer = getattr(_replying, "waiting", None)
    waiting: list[Callable[[], object]] = []
    _replying.waiting = waiting
    try:
        yield
    finally:
        _replying.waiting = outer
        for work in waiting:
            try:
                work()
            except Exception:  # noqa: BLE001 - logged: the next message must still be answered
                logger.exception("clean-up after a reply failed")


__all__ = ["after_reply", "give_back_freed_memory", "reply_first"]
