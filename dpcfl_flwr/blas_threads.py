"""How many BLAS threads the server's numerical steps use: one for the many small calls of a
clustering fit or an RPCA iteration, the process's own count for the few large products.

Measured at 1,000 silos on 2 cores (bench/scaling.py, server part): the noise-aware
clustering took 3.9 s of wall time with OpenBLAS's default two threads and 2.6 s with one,
since its hundreds of n x n by n x k products and small solves spend more on handing work
to a second thread than they gain from it; its n x n Gram matrix of the updates (n^2 p
multiply-adds, compute-bound) took 0.5 s on two threads against 0.8-0.9 s on one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from threadpoolctl import ThreadpoolController

_controller: ThreadpoolController | None = None
#: The BLAS thread count outside the innermost :func:`one_blas_thread`, None outside any.
_outer_threads: ContextVar[int | None] = ContextVar("outer_blas_threads", default=None)


def _blas() -> ThreadpoolController:
    """One controller for the process: building one walks every loaded library."""
    global _controller
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller


def _current_threads() -> int:
    counts = [lib.num_threads for lib in _blas().select(user_api="blas").lib_controllers]
    return max(counts, default=1)


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the body on one BLAS thread; :func:`outer_blas_threads` inside it gives the large
    products back the count BLAS had before."""
    outer = _outer_threads.get()
    token = _outer_threads.set(_current_threads() if outer is None else outer)
    try:
        with _blas().limit(limits=1, user_api="blas"):
            yield
    finally:
        _outer_threads.reset(token)


@contextmanager
def outer_blas_threads() -> Iterator[None]:
    """Inside :func:`one_blas_thread`, run the body on the BLAS threads the process had
    outside it (a compute-bound product such as a Gram matrix); elsewhere, change nothing."""
    outer = _outer_threads.get()
    if outer is None:
        yield
        return
    with _blas().limit(limits=outer, user_api="blas"):
        yield
