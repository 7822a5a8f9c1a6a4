"""The simulation engine's dispatcher, woken by a stored message instead of a 0.1 s timer.

Built on Flower's own in-memory link state and grid, set up the way Flower's
``_run_simulation`` sets them up, so the dispatcher sees exactly what it sees in a run.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from queue import Empty, Queue

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from dpcfl_flwr.flower_compat.engine import FALLBACK_SCAN_SECONDS, wait_for_replies, woken_dispatch

RUN_ID, TASK_ID = 7, 11


@pytest.fixture
def engine(task_identity):
    """(state, grid, node ids) of a run with three registered nodes; the ServerApp's pushes
    come from the SuperLink's node id, as in a simulation."""
    task_identity(TASK_ID, RUN_ID, SUPERLINK_NODE_ID)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=RUN_ID)
    run.primary_task_id, run.federation_id = TASK_ID, NOOP_FEDERATION_ID
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
    nodes = list(vce_api._register_nodes(3, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes


@pytest.fixture
def dispatched(engine):
    """(grid, nodes, queue) with the woken dispatcher running on the engine's state; stopped
    afterwards, and checked to stop within its fallback period."""
    state, grid, nodes = engine
    queue: Queue[Message] = Queue()
    stop = threading.Event()
    with woken_dispatch():
        dispatcher = threading.Thread(target=vce_api.add_messages_to_queue, daemon=True,
                                      args=(state, queue, dict.fromkeys(nodes), stop))
        dispatcher.start()
        try:
            yield grid, nodes, queue
        finally:
            stop.set()
            dispatcher.join(timeout=2 * FALLBACK_SCAN_SECONDS)
    assert not dispatcher.is_alive()
    assert "store_message_ins" not in vars(state)  # the state's own method is back
    assert vce_api.add_messages_to_queue.__module__ == vce_api.__name__  # and Flower's loop


def _push(grid, node):
    return list(grid.push_messages([Message(RecordDict(), dst_node_id=node,
                                            message_type="train")]))[0]


def test_a_pushed_message_reaches_the_workers_queue_without_the_engines_poll(dispatched):
    grid, nodes, queue = dispatched
    time.sleep(0.2)  # the dispatcher is waiting: its first scan found nothing
    delays = []
    for node in nodes * 3:
        pushed = time.monotonic()
        message_id = _push(grid, node)
        assert queue.get(timeout=2 * FALLBACK_SCAN_SECONDS).metadata.message_id == message_id
        delays.append(time.monotonic() - pushed)
        time.sleep(0.03)  # the next push arrives while the dispatcher waits
    # Flower's own loop waits 0.1 s between scans: on average 50 ms from push to queue.
    assert statistics.median(delays) < 0.02, delays
    with pytest.raises(Empty):
        queue.get_nowait()  # each message handed out once


def test_messages_stored_during_a_scan_are_not_left_for_the_fallback(dispatched):
    # Twenty rounds of three back-to-back pushes: some land while the dispatcher scans, and a
    # wake-up lost there would cost a whole fallback period (Flower's loop: up to 0.1 s each).
    grid, nodes, queue = dispatched
    started = time.monotonic()
    for _ in range(20):
        pushed = {_push(grid, node) for node in nodes}
        got = {queue.get(timeout=2 * FALLBACK_SCAN_SECONDS).metadata.message_id
               for _ in nodes}
        assert got == pushed
    elapsed = time.monotonic() - started
    assert elapsed < FALLBACK_SCAN_SECONDS / 2, elapsed


def _reply_later(state, message: Message, seconds: float) -> threading.Timer:
    """The engine storing ``message``'s reply ``seconds`` from now, as a worker finishing."""
    reply = Message(RecordDict(), reply_to=message)
    reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as the engine's worker does
    timer = threading.Timer(seconds, state.store_message_res, args=(reply,))
    timer.start()
    return timer


def test_the_serverapps_wait_ends_when_the_engine_stores_a_reply(dispatched):
    grid, nodes, queue = dispatched
    wait_for_replies(grid, 0.0)  # forget replies of before
    message_id = _push(grid, nodes[0])
    delivered = queue.get(timeout=2 * FALLBACK_SCAN_SECONDS)
    started = time.monotonic()
    replying = _reply_later(grid.state, delivered, 0.2)
    wait_for_replies(grid, 5.0)
    waited = time.monotonic() - started
    replying.join()
    assert [m.metadata.reply_to_message_id for m in grid.pull_messages([message_id])] == [
        message_id]
    assert waited < 0.2 + 0.05, waited
    started = time.monotonic()
    wait_for_replies(grid, 0.3)  # nothing stored since: the whole wait
    assert time.monotonic() - started >= 0.3


def test_a_grid_outside_a_woken_engine_just_sleeps(engine):
    _, grid, _ = engine  # Flower's grid on a state no woken dispatcher serves
    started = time.monotonic()
    wait_for_replies(grid, 0.3)
    assert time.monotonic() - started >= 0.3
