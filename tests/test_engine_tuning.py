"""The simulation engine's dispatcher, woken by a stored message instead of a 0.1 s timer.

Built on Flower's own in-memory link state and grid, set up the way Flower's
``_run_simulation`` sets them up, so the dispatcher sees exactly what it sees in a run.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
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

from dpcfl_flwr.flower_compat.engine import (
    FALLBACK_SCAN_SECONDS,
    replies_wake_waits,
    wait_for_replies,
    woken_dispatch,
)
from dpcfl_flwr.strategies.exchange import exchange

RUN_ID, TASK_ID = 7, 11


def _engine(nodes: int):
    """(state, grid, node ids) of a run with ``nodes`` registered nodes."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=RUN_ID)
    run.primary_task_id, run.federation_id = TASK_ID, NOOP_FEDERATION_ID
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
    node_ids = list(vce_api._register_nodes(nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, node_ids


@pytest.fixture
def engine(task_identity):
    """(state, grid, node ids) of a run with three registered nodes; the ServerApp's pushes
    come from the SuperLink's node id, as in a simulation."""
    task_identity(TASK_ID, RUN_ID, SUPERLINK_NODE_ID)
    return _engine(3)


@contextmanager
def dispatcher_on(state, nodes):
    """The woken dispatcher running on ``state`` for ``nodes``: its queue. Checked to stop
    within its fallback period and to give the state and Flower's loop back."""
    queue: Queue[Message] = Queue()
    stop = threading.Event()
    with woken_dispatch():
        dispatcher = threading.Thread(target=vce_api.add_messages_to_queue, daemon=True,
                                      args=(state, queue, dict.fromkeys(nodes), stop))
        dispatcher.start()
        try:
            yield queue
        finally:
            stop.set()
            dispatcher.join(timeout=2 * FALLBACK_SCAN_SECONDS)
    assert not dispatcher.is_alive()
    assert "store_message_ins" not in vars(state)  # the state's own method is back
    assert vce_api.add_messages_to_queue.__module__ == vce_api.__name__  # and Flower's loop


@pytest.fixture
def dispatched(engine):
    """(grid, nodes, queue) with the woken dispatcher running on the engine's state."""
    state, grid, nodes = engine
    with dispatcher_on(state, nodes) as queue:
        yield grid, nodes, queue


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


def test_a_round_of_many_silos_costs_one_check_per_message(task_identity):
    # Flower's loop asks every node for a message, and each ask walks every stored message:
    # a round of n silos cost ~n^2 / 2 checks (7 s of CPU a scan at 1,008 silos).
    task_identity(TASK_ID, RUN_ID, SUPERLINK_NODE_ID)
    state, grid, nodes = _engine(300)
    checks: Counter[int] = Counter()  # Flower's message check, by calling thread
    flowers_check = state._check_stored_messages

    def counted(*args, **kwargs):
        checks[threading.get_ident()] += 1
        return flowers_check(*args, **kwargs)

    state._check_stored_messages = counted
    with dispatcher_on(state, nodes) as queue:
        pushed = list(grid.push_messages([Message(RecordDict(), dst_node_id=node,
                                                  message_type="train") for node in nodes]))
        got = [queue.get(timeout=2 * FALLBACK_SCAN_SECONDS).metadata.message_id
               for _ in nodes]
        time.sleep(1.5 * FALLBACK_SCAN_SECONDS)  # a sweep of the state runs meanwhile
    assert sorted(got) == sorted(pushed)
    assert queue.empty()  # each message handed out once, the sweep's included
    by_dispatcher = sum(checks.values()) - checks[threading.get_ident()]
    assert by_dispatcher <= len(nodes), by_dispatcher


def test_a_nodes_second_message_is_handed_out_without_a_timer(engine):
    # Two messages for one node wait when the dispatcher starts; its first look hands out one
    # (one per look, as Flower's loop), and the second must not wait for the fallback scan.
    state, grid, nodes = engine
    pushed = [_push(grid, nodes[0]) for _ in range(2)]
    started = time.monotonic()
    with dispatcher_on(state, nodes) as queue:
        got = [queue.get(timeout=2 * FALLBACK_SCAN_SECONDS).metadata.message_id
               for _ in pushed]
        elapsed = time.monotonic() - started
    assert got == pushed
    assert elapsed < FALLBACK_SCAN_SECONDS / 2, elapsed


def _exchange_with_replies(grid, queue, nodes, every: float, poll_seconds: float = 0.0):
    """Run the ServerApp's exchange of one message per entry of ``nodes`` while the engine
    stores a reply every ``every`` s, each poll of the grid taking ``poll_seconds`` more.
    Returns (the exchange, the polls' start times)."""
    pulls = []
    flowers_pull = grid.pull_messages

    def timed_pull(message_ids):
        pulls.append(time.monotonic())
        time.sleep(poll_seconds)
        return flowers_pull(message_ids)

    grid.pull_messages = timed_pull
    timers = []

    def reply_to_what_is_dispatched():
        for k in range(len(nodes)):
            delivered = queue.get(timeout=2 * FALLBACK_SCAN_SECONDS)
            timers.append(_reply_later(grid.state, delivered, every * (k + 1)))

    replier = threading.Thread(target=reply_to_what_is_dispatched)
    replier.start()
    messages = {k: Message(RecordDict(), dst_node_id=node, message_type="train")
                for k, node in enumerate(nodes)}
    result = exchange(grid, messages, timeout=10.0)
    replier.join()
    for timer in timers:
        timer.join()
    assert sorted(result.replies) == list(messages) and not result.missing
    return result, pulls


def test_the_serverapp_polls_a_woken_grid_about_once_a_reply(dispatched):
    # Replies stored 0.15 s apart for 0.45 s: a poll every 50 ms would be about ten.
    grid, nodes, queue = dispatched
    assert replies_wake_waits(grid)
    _, pulls = _exchange_with_replies(grid, queue, nodes, every=0.15)
    assert len(pulls) <= 2 * len(nodes), len(pulls)


def test_slow_polls_of_a_woken_grid_are_spaced_by_their_cost(dispatched):
    # A poll that takes 30 ms (as Flower's in-memory one at ~3,000 pending messages) leaves
    # 20x that before the next, however often replies come (here every 50 ms for 0.6 s).
    grid, nodes, queue = dispatched
    _, pulls = _exchange_with_replies(grid, queue, nodes * 4, every=0.05, poll_seconds=0.03)
    gaps = [b - a for a, b in zip(pulls, pulls[1:], strict=False)]
    assert gaps and min(gaps) >= 20 * 0.03, gaps


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
    assert not replies_wake_waits(grid)
    started = time.monotonic()
    wait_for_replies(grid, 0.3)
    assert time.monotonic() - started >= 0.3
