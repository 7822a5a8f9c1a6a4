"""The in-SuperNode runtime acts on Flower's own NodeState exactly as the HTTP Runtime API would:
tasks are acquired once, every task call needs a live token, and a lost task never stops the
SuperNode (the deployment tests run a whole R-DPCFL run through it over gRPC)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import types

import pytest
from flwr.clientapp import ClientApp
from flwr.proto.message_pb2 import PullObjectRequest  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    PullTaskInputRequest,
)
from flwr.supercore.constant import TaskType
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supernode.nodestate import NodeStateFactory

from dpcfl_flwr.flower_compat.direct_runtime import (
    CLIENTAPP_NICENESS,
    DirectRuntimeClient,
    direct_link,
    runtime_api_address,
    serve_in_supernode,
    serve_or_stop,
    yield_to_the_supernode,
)
from dpcfl_flwr.flower_compat.warm_runtime import WarmRuntime

CLIENT_APP = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])


@pytest.fixture
def factory() -> NodeStateFactory:
    return NodeStateFactory(ObjectStoreFactory())


def _pending_task(factory: NodeStateFactory) -> int:
    task_id = factory.state().create_task(task_type=TaskType.CLIENT_APP, run_id=7,
                                          fab_hash="f" * 64)
    assert task_id is not None
    return task_id


def test_a_pending_task_is_acquired_once_with_a_token_the_state_knows(factory):
    task_id = _pending_task(factory)
    acquirer = DirectRuntimeClient(factory)
    first = acquirer.AcquireTask(CLIENT_APP)
    assert first.task.task_id == task_id and first.token
    assert factory.state().get_task_by_token(first.token).task_id == task_id
    assert not acquirer.AcquireTask(CLIENT_APP).token  # claimed: nobody gets it twice
    assert not acquirer.AcquireTask(AcquireTaskRequest()).HasField("task")


def test_task_calls_without_a_valid_token_are_refused_as_over_http(factory):
    _pending_task(factory)
    for token in (None, "not-a-token"):
        client = DirectRuntimeClient(factory, token)
        for call, request in ((client.PullTaskInput, PullTaskInputRequest()),
                              (client.PullObject, PullObjectRequest(object_id="x"))):
            with pytest.raises(FlowerError) as refused:
                call(request)
            assert refused.value.code == ApiErrorCode.RUNTIME_AUTHENTICATION_FAILED


def test_a_task_call_with_its_token_reaches_flowers_handler(factory):
    _pending_task(factory)
    acquired = DirectRuntimeClient(factory).AcquireTask(CLIENT_APP)
    client = DirectRuntimeClient(factory, acquired.token)
    # Flower's handler, past authentication: the run was never stored, and it says so
    with pytest.raises(FlowerError) as missing:
        client.PullTaskInput(PullTaskInputRequest())
    assert missing.value.code == ApiErrorCode.RUN_ID_NOT_FOUND
    assert not client.PullObject(PullObjectRequest(object_id="absent")).object_found


def test_a_heartbeat_keeps_a_claimed_task_and_a_lost_one_only_logs(factory, caplog):
    _pending_task(factory)
    acquired = DirectRuntimeClient(factory).AcquireTask(CLIENT_APP)
    ours = "dpcfl_flwr.flower_compat.direct_runtime"
    with caplog.at_level(logging.WARNING, logger=ours):
        assert DirectRuntimeClient(factory, acquired.token).task_heartbeat()
        assert not [r for r in caplog.records if r.name == ours]
        # Flower's HTTP heartbeat would raise SIGINT here, in the SuperNode's own process
        assert DirectRuntimeClient(factory, "gone").task_heartbeat()
    assert [r.message for r in caplog.records if r.name == ours] == [
        "the SuperNode no longer holds this ClientApp task"]


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", "127.0.0.1:9100"), ("0.0.0.0", "127.0.0.1:9100"), ("::", "[::1]:9100"),
    ("silo.local", "silo.local:9100")])
def test_the_fresh_process_path_reaches_the_runtime_api_where_it_listens(host, expected):
    assert runtime_api_address(host, 9100) == expected


class _BrokenFactory(NodeStateFactory):
    def state(self):  # what a corrupted SuperNode state would do to the runtime
        raise RuntimeError("state unavailable")


def test_a_failing_runtime_stops_its_supernode_gracefully(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        runtime = WarmRuntime("127.0.0.1:1", ClientApp(), 0.01,
                              connect=direct_link(_BrokenFactory(ObjectStoreFactory())))
        thread = threading.Thread(target=serve_or_stop, args=(runtime,))
        thread.start()
        thread.join(timeout=10)
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs in this (main) thread
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _CountingFactory(NodeStateFactory):
    """Flower's factory, counting the runtime's looks at the state (one per AcquireTask);
    once ``ending``, a look ends the runtime's thread (SystemExit, as the SuperNode's own end
    would), so the test leaves no thread polling behind it."""

    looks = 0
    ending = False

    def state(self):
        self.looks += 1
        if self.ending:
            raise SystemExit(0)
        return super().state()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its end
def test_the_supernode_starts_the_runtime_with_its_api_and_its_loop_wakes_it():
    factory = _CountingFactory(ObjectStoreFactory())
    started = object()
    cli = types.SimpleNamespace(_start_supernode_http_api=lambda config, state: started)
    runs = iter([None, 7])
    loop = types.SimpleNamespace(_pull_and_store_message=lambda **_: next(runs))
    done = threading.Event()
    serve_in_supernode(cli, loop, ClientApp, done)
    config = types.SimpleNamespace(host="0.0.0.0", port=9100)
    assert cli._start_supernode_http_api(config, factory) is started  # Flower's result
    (thread,) = [t for t in threading.enumerate() if t.name == "dpcfl-clientapp"]
    assert thread.daemon
    _wait_for(lambda: factory.looks >= 1)  # the first look, then a 10 s wait
    first = factory.looks
    assert loop._pull_and_store_message(state=None) is None  # nothing stored: no wake-up
    time.sleep(0.3)
    assert factory.looks == first
    assert loop._pull_and_store_message(state=None) == 7  # a message stored: look at once
    _wait_for(lambda: factory.looks > first, seconds=5)  # well before the 10 s poll
    assert thread.is_alive() and not done.is_set()  # no task in the state: back to waiting
    factory.ending, runs = True, iter([7])
    loop._pull_and_store_message(state=None)  # wakes it for the look that ends it
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's niceness: Linux")
def test_the_clientapp_thread_yields_to_its_supernodes_threads():
    seen = {}

    def clientapp_thread() -> None:
        seen["yielded"] = yield_to_the_supernode()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=clientapp_thread)
    worker.start()
    worker.join()
    assert seen["yielded"]
    assert seen["thread"] == min(19, before + CLIENTAPP_NICENESS)  # the thread that trains
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the rest
