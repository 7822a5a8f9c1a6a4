"""The few largest eigenpairs of a symmetric n x n matrix, the one eigensolver both
clusterings use: the projection's principal axes (:mod:`.gmm`) and the noise-aware
signal Gram's refits and axes (:mod:`.noise_aware`) need only the top d of n."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse.linalg

#: From this many silos on, the top eigenpairs come from ARPACK's Lanczos iteration on the
#: dense matrix (n^2 per product) rather than LAPACK's tridiagonal reduction (n^3): at 1,000
#: silos 0.04 s against 0.09 s a call, the same pairs to ~1e-14 (bench/scaling.py, server
#: part); below it LAPACK is as fast and has no iteration that could stall.
LANCZOS_FROM = 400


def top_eigenpairs(matrix: np.ndarray, count: int, start: np.ndarray | None = None,
                   tol: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` largest eigenvalues of a symmetric matrix, largest first, and their
    eigenvectors (columns): by Lanczos at ``LANCZOS_FROM`` rows or more (to ``tol``, from
    ``start`` or else a fixed start vector, so a run repeats itself), else,
    or when ARPACK fails (no convergence, a zero matrix), LAPACK asked for those pairs alone
    (about a quarter of the full decomposition's cost at 1,000 silos).

    ``start`` (n,): a vector near the wanted eigenvectors' span, e.g. the sum of a nearby
    matrix's; the noise-aware refits, whose matrices differ only on the diagonal, took 0.72
    s instead of 0.88 at 1,000 silos from the previous refit's (the same pairs to 1e-14).

    ``tol``: Lanczos' relative accuracy of the eigenvalues (0: machine precision), for a
    caller that needs less (the noise-aware refits, which stop at a 1e-6 change)."""
    n = len(matrix)
    count = min(count, n)
    if n >= LANCZOS_FROM and count < n // 4:
        if start is None or not np.any(start):
            start = np.random.default_rng(0).standard_normal(n)
        try:
            values, vectors = scipy.sparse.linalg.eigsh(matrix, k=count, which="LA", v0=start,
                                                        tol=tol)
        except scipy.sparse.linalg.ArpackError:  # no convergence, or a start it cannot
            pass                                 # use (a zero matrix): LAPACK answers
        else:
            order = np.argsort(values)[::-1]
            return values[order], vectors[:, order]
    values, vectors = scipy.linalg.eigh(matrix, subset_by_index=[n - count, n - 1])
    return values[::-1], vectors[:, ::-1]
