"""Shared fixtures, and the order in which test workers take the files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
from flwr.supercore.task_identity import TaskIdentity

from dpcfl_flwr.privacy.pld_store import STORE_VARIABLE

_SESSION_STORE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """In a test worker (pytest-xdist), torch computes on one intra-op thread: beside the
    other worker, torch's two threads per process on two cores wait on each other (a test
    of in-process training took 232 s where it takes 44 s alone).

    The suite's processes keep their PLD figures in one store for the session
    (privacy/pld_store.py), set up before the workers start, so they and every process
    they start share it: the runs of the suite calibrate the same few schedules again and
    again, in silo after silo (a calibration: 3-10 s of CPU). Each figure is still composed
    once per session by the code under test, and tests of the store set their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    elif not os.environ.get(STORE_VARIABLE):
        store = tempfile.mkdtemp(prefix="dpcfl-pld-store-")
        os.environ[STORE_VARIABLE] = store
        config.stash[_SESSION_STORE] = store


def pytest_unconfigure(config: pytest.Config) -> None:
    store = config.stash.get(_SESSION_STORE, None)
    if store is not None:
        shutil.rmtree(store, ignore_errors=True)
        os.environ.pop(STORE_VARIABLE, None)


@pytest.fixture()
def task_identity():
    """Messages read the process' task identity, which Flower's runtime sets for a ServerApp
    process; tests that build messages outside a runtime set it with the function this
    yields, ``(task_id, run_id, node_id)``, and get the previous identity back afterwards."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)

    def set_identity(task_id: int, run_id: int, node_id: int) -> None:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (
            task_id, run_id, node_id)

    yield set_identity
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture()
def server_task_identity(task_identity):
    """The identity of a ServerApp's task in tests: task 1 of run 1."""
    task_identity(1, 1, 0)


@pytest.fixture()
def one_torch_thread():
    """Torch on one intra-op thread for the test (the machine's cores are shared), restored
    afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _slow_marks(config: pytest.Config, test_file: str) -> int:
    """How many ``pytest.mark.slow`` marks ``test_file`` (a path from the root) holds, read
    from its text: the scheduler runs before any worker reports its tests' marks."""
    try:
        return (Path(config.rootpath) / test_file).read_text().count("pytest.mark.slow")
    except OSError:
        return 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """With the tests spread over workers file by file (``-n 2 --dist loadfile``, as
    ``make test`` runs them), the files holding slow tests are handed out first, those with
    the most slow tests first; the many quick files then fill the gaps. pytest-xdist orders
    files by their number of tests alone, which left the long deployment files to the end,
    where one worker ran them while the other had nothing left. Other ``--dist`` modes keep
    pytest-xdist's own scheduler."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowFilesFirst(LoadFileScheduling):
        ordered = False  # the whole queue is reordered once, before the first hand-out

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:
                order = sorted(self.workqueue, key=lambda f: -_slow_marks(config, f))
                self.workqueue = OrderedDict((f, self.workqueue[f]) for f in order)
                self.ordered = True
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)
