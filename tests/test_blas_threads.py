"""The server's numerical steps choose their BLAS threads: one for the many small calls, the
process's own count for the large Gram products (dpcfl_flwr/blas_threads.py)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from dpcfl_flwr.blas_threads import one_blas_thread, outer_blas_threads
from dpcfl_flwr.clustering import NoiseAwareClusterer, UpdateClusterer, gmm, noise_aware


def blas_threads() -> int:
    """What BLAS runs on now, read by threadpoolctl's own scan (not our controller)."""
    return max(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")


def test_one_thread_inside_the_process_count_for_the_large_products() -> None:
    with threadpool_limits(3, "blas"):
        with outer_blas_threads():  # outside any one-thread section: nothing changes
            assert blas_threads() == 3
        with one_blas_thread():
            assert blas_threads() == 1
            with outer_blas_threads():
                assert blas_threads() == 3
            assert blas_threads() == 1
            # nested: the large products still get the process's 3
            with one_blas_thread(), outer_blas_threads():
                assert blas_threads() == 3
        assert blas_threads() == 3


@pytest.mark.parametrize("clusterer", [UpdateClusterer, NoiseAwareClusterer])
def test_a_clustering_fit_runs_its_eigensolver_on_one_thread(clusterer, monkeypatch) -> None:
    """The fit's small products (eigensolver, EM) run on one BLAS thread whatever the process
    has, and the process's count is back after it."""
    seen: list[int] = []

    def recording(matrix, count, *args):
        seen.append(blas_threads())
        return original(matrix, count, *args)

    original = gmm.top_eigenpairs
    monkeypatch.setattr(gmm, "top_eigenpairs", recording)
    monkeypatch.setattr(noise_aware, "top_eigenpairs", recording)
    rng = np.random.default_rng(0)
    updates = np.repeat(rng.normal(size=(3, 400)), 6, axis=0) + 0.1 * rng.normal(size=(18, 400))
    with threadpool_limits(2, "blas"):
        fitted = clusterer(3, n_components=2).fit(updates)
        assert blas_threads() == 2
    assert seen and set(seen) == {1}
    assert fitted.n_clusters_ == 3
