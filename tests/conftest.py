"""Shared fixtures."""

from __future__ import annotations

import pytest
from flwr.supercore.task_identity import TaskIdentity


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
