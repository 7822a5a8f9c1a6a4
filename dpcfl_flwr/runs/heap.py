"""Freed heap memory handed back to the operating system once a deployed silo has gone idle.

A silo's round takes memory it frees before it replies: the full-batch round (the
per-sample gradients and activations of a chunk of up to 512 records) and the privacy
accountant's compositions. glibc's ``malloc`` keeps freed memory for reuse rather than
return it, so a silo process held its largest round's memory for the rest of its life: on
the quick example, a silo's resident memory stayed ~150 MB above what it held between
rounds, and 21 silos on one machine held 21 such peaks. ``malloc_trim(0)`` returns the free
pages of every heap. It is called only outside simulation (there one process serves every
silo, one message after another).

When: once the silo has had no message for :data:`IDLE_SECONDS` (:func:`message_started`,
:func:`message_answered`). A silo whose next message comes sooner needs that memory again:
giving it back after every reply cost the trim (2-4 ms of CPU a message on the quick example,
measured in the silos of a gRPC run), and on a machine whose cores the silos share that CPU
was taken from the silos still training; the next round then maps the memory afresh. A run
that pauses (the server evaluating, waiting for late silos, or done) gets the memory back
within seconds. Before a round trains, the silo still gives back what its accountant freed
(silo/silo.py, ``check``), so a round's peak stays the larger of the two, not their sum.

The silo's reply need not wait for work that is not the answer: where the reply's sender says
so (a warm ClientApp's runtime, :func:`reply_first`), :func:`after_reply` holds such work until
the reply has left.
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


#: Seconds without a message after which a silo gives back what its messages freed. In a
#: gRPC run of the quick example each silo's next round reached its accountant's check
#: within 6 s of its reply (its message came sooner), so close rounds no longer trim.
IDLE_SECONDS = 10.0

_idle = threading.Lock()  # guards the two below
_answering = 0  # messages being answered in this process
_pending: threading.Timer | None = None  # the trim that waits for IDLE_SECONDS of no message


def message_started() -> None:
    """A message is being answered: a trim waiting for the silo to go idle is called off."""
    global _answering, _pending
    with _idle:
        _answering += 1
        if _pending is not None:
            _pending.cancel()
            _pending = None


def message_answered() -> None:
    """The message :func:`message_started` announced is answered: when no other is being
    answered, freed memory goes back to the system after :data:`IDLE_SECONDS` with no new
    message."""
    global _answering, _pending
    with _idle:
        _answering = max(_answering - 1, 0)
        if _answering or _pending is not None:
            return
        timer = threading.Timer(IDLE_SECONDS, _trim_if_still_idle)
        timer.daemon = True  # a process that ends does not wait to trim
        _pending = timer
        timer.start()


def _trim_if_still_idle() -> None:
    global _pending
    with _idle:
        if _pending is not threading.current_thread():  # called off meanwhile
            return
        _pending = None
    give_back_freed_memory()


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


__all__ = ["IDLE_SECONDS", "after_reply", "give_back_freed_memory", "message_answered",
           "message_started", "reply_first"]
