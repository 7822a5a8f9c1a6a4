"""Flower 1.39's SuperLink answering a poll when there is complete work for the poller: the
internals behind ``deploy/superlink_launcher.py``.

A Flower 1.39 SuperNode asks the SuperLink for work with a unary ``PullMessages`` call and,
when there is none, sleeps and asks again. Every poll is a TLS request with a
node-authentication signature that both sides handle in Python (~6 ms of CPU together,
bench/RESULTS.md "Idle deployment"), so frequent polls cost the training cores CPU, and rare
polls make a round reach its silos late. This launcher runs Flower's own SuperLink with one
change: a ``PullMessages`` that finds nothing for its node waits (up to ``--pull-hold``
seconds) until an instruction for that node is stored *with all its objects* and then
answers with it; otherwise it answers "nothing" when the hold runs out, as before. Neither
side's protocol changes: a SuperNode of any 1.39 build simply sees a slow empty answer, and
with :mod:`.supernode` it polls again at once.

"All its objects": the ServerApp pushes a message (which stores it and opens an object push
session) and then the message's objects. A SuperNode that pulled the message before the
objects were in would get "object unavailable" and back off for a second, so the wait ends
when the push session that carries the message's missing objects is complete, and a poll that
arrives while its instruction is stored but still missing objects waits for them as well.

The hold ends early when the call ends (the SuperNode went away, or the SuperLink is
stopping), and then nothing is pulled: a message marked delivered to a caller that is gone
would be lost.

The ServerApp's side has the same race the other way round: Flower's Runtime API hands it a
reply as soon as the reply message is stored, before the SuperNode has pushed the reply's
objects, and Flower's ``Grid.pull_messages`` then backs off a second on the missing object
with the poll's other replies waiting behind it. Here the ServerApp's ``pull_messages`` asks
only for replies whose objects are all in and, when none is, waits up to 1 s for one (its
HTTP client waits 30 s); a ServerApp that polls again at once then hears of every reply as it
completes. Both changes patch Flower's classes only for the Flower version they were written
against; on any other version, or with ``--pull-hold 0``, Flower's polling runs unchanged and
the launcher says so. On flwr 1.39.0, whatever the hold, the ServerApp's requests also skip
the Control API's middleware (:mod:`.control_middleware`), and a SuperNode whose activation
is refused is told why, where Flower says only "Failed to activate SuperNode." and logs the
reason on the SuperLink: its public key is not registered, or a node with its key is online
(another instance of the silo, or its crashed previous session, with the seconds until that
expires). A message pulled by a silo whose session then ended (it was killed and came back
at once) gets an error reply at the ServerApp's next request, so the round goes on without
that silo (:mod:`.ended_sessions`).

A ServerApp the SuperExec launched gets :data:`LAUNCH_GRACE` seconds, not Flower's 30, to
start (from the SuperExec's claim of the run's task to the ServerApp's activation of it):
Flower takes a claim that has not been activated after 30 s for a failed launch and hands the
task to the SuperExec again, which starts another ``flwr-serverapp``. On a loaded machine a
ServerApp's start (imports, the FAB's installation) takes minutes: the quick example's 21
silos in docker compose, on 2 cores shared with other jobs, had ten ``flwr-serverapp``
processes starting side by side, each launched 30-40 s after the one before, each slowing
the others. The price: a ServerApp that dies while it starts is launched again after
:data:`LAUNCH_GRACE` instead of 30 s.

The SuperLink's SQLite state (``dpcfl server --state``, kept across restarts) waits up to
:data:`SQLITE_BUSY_MS` for a lock, not Flower's 5 s: when 21 silos and the SuperLink share a
starved machine, the thread holding the write lock can wait longer than that for a core, and
Flower then fails the request ("database is locked"); the ServerApp's ``pull-messages``
answered 500 and the run ended in round 1 (the quick example in docker compose, load average
50-70 on 2 cores).

All of it is latency tuning: :func:`run_superlink` installs it only while the gate of
:mod:`dpcfl_flwr.flower_compat` is open, and otherwise runs stock ``flower-superlink``.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .gate import KEY_NOT_REGISTERED, NODE_ONLINE

T = TypeVar("T")

REPLY_HOLD = 1.0  # seconds the ServerApp's empty reply poll may wait (its HTTP timeout: 30 s)
#: Seconds a launched ServerApp may take from the SuperExec's claim of its task to activating
#: it before Flower launches another (Flower: 30).
LAUNCH_GRACE = 600.0
#: How long a SuperLink's SQLite connection waits for a lock, ms (Flower: 5000).
SQLITE_BUSY_MS = 60_000


class Arrivals:
    """What became complete (stored with all its objects) for whom: per SuperNode, a count of
    its complete instructions; for the ServerApp, a count of complete replies and the
    instructions whose reply is being stored or still misses objects. A held pull waits for its
    count to change. Objects arrive in a push session after the message that needs them, so
    a message with missing objects becomes complete when its session ends."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count: dict[int, int] = defaultdict(int)  # per SuperNode
        self._half_pushed: dict[int, int] = defaultdict(int)  # per SuperNode: objects to come
        self._replies = 0
        # instruction id -> replies to it being stored, or stored while missing objects
        self._incomplete_replies: dict[str, int] = defaultdict(int)
        self._on_session_end: dict[str, list[Callable[[], None]]] = defaultdict(list)
        # Held by a pull while Flower's handler runs, and by a store while it marks its
        # message as coming: no message becomes storable between a pull's check and its
        # handler. Never taken while waiting for the state: a store takes it before Flower's
        # store, and the lock above is only ever taken inside it or on its own.
        self._gate = threading.Lock()

    def seen(self, node_id: int) -> int:
        with self._changed:
            return self._count[node_id]

    def pull_complete_replies(self, instruction_ids: Sequence[str],
                              pull: Callable[[list[str]], T]) -> tuple[int, T]:
        """(the count of complete replies, ``pull`` of those ``instruction_ids`` whose reply is
        not being stored or half-pushed). No reply is stored while ``pull`` runs, so it
        cannot hand over one whose objects are still coming."""
        with self._gate:
            with self._changed:
                ready = [i for i in instruction_ids if not self._incomplete_replies.get(i)]
                seen = self._replies
            return seen, pull(ready)

    def pull_if_none_half_pushed(self, node_id: int, pull: Callable[[], T]) -> T | None:
        """``pull()``, unless an instruction for ``node_id`` is being stored or waits for its
        objects (None); no instruction is stored while ``pull`` runs."""
        with self._gate:
            with self._changed:
                if self._half_pushed[node_id] > 0:
                    return None
            return pull()

    def storing(self, message: Any, superlink_node_id: int) -> Callable[[bool, str, bool], None]:
        """Mark ``message`` as coming before Flower stores it (a pull meanwhile passes it
        over); the returned function settles the mark with the store's outcome: (stored,
        push session, whether objects are missing)."""
        metadata = message.metadata
        reply_to = metadata.reply_to_message_id
        node_id = None if reply_to or metadata.dst_node_id == superlink_node_id else (
            metadata.dst_node_id)
        with self._gate, self._changed:
            if reply_to:
                self._incomplete_replies[reply_to] += 1
            elif node_id is not None:
                self._half_pushed[node_id] += 1

        def settle(stored: bool, session_id: str, missing: bool) -> None:
            with self._changed:
                def done() -> None:
                    if reply_to:
                        self._incomplete_replies[reply_to] -= 1
                        if not self._incomplete_replies[reply_to]:
                            del self._incomplete_replies[reply_to]
                        self._replies += 1  # a change to wake the ServerApp's pull on
                    elif node_id is not None:
                        self._half_pushed[node_id] -= 1
                        self._count[node_id] += 1  # a change to wake the node's pull on
                self._settle(done, session_id if stored and missing else None)

        return settle

    def _settle(self, done: Callable[[], None], session_id: str | None) -> None:
        if session_id is None:
            done()
            self._changed.notify_all()
        else:
            self._on_session_end[session_id].append(done)

    def session_ended(self, session_id: str) -> None:
        with self._changed:
            pending = self._on_session_end.pop(session_id, [])
            for done in pending:
                done()
            if pending:
                self._changed.notify_all()

    def wake_all(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, changed: Callable[[], bool], timeout: float) -> bool:
        """Until ``changed()`` (called under the lock) or ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(changed, timeout)

    def wait_for_node(self, node_id: int, seen: int, timeout: float,
                      ended: Callable[[], bool]) -> bool:
        return self.wait(lambda: self._count[node_id] != seen or ended(), timeout)

    def wait_for_replies(self, seen: int, timeout: float) -> bool:
        return self.wait(lambda: self._replies != seen, timeout)


def announce_complete_messages(state_class: Any, arrivals: Arrivals,
                               superlink_node_id: int) -> None:
    """Make ``state_class`` (a LinkState) tell ``arrivals`` when a message is stored with
    all its objects: at once when none is missing, else when the push session that brings
    them ends."""
    store = state_class.store_message_and_object_tree
    end_session = state_class._cleanup_push_session
    store_object = state_class.store_object
    # A session ends inside the store_object call that brings its last object; with SQL
    # state that call's transaction commits only when it returns, so the news waits for it.
    calls = threading.local()

    def store_message_and_object_tree(self: Any, message: Any, object_tree: Any,
                                      session_id: str) -> tuple[bool, list[str]]:
        settle = arrivals.storing(message, superlink_node_id)
        stored, missing = False, []
        try:
            stored, missing = store(self, message, object_tree, session_id)
        finally:
            settle(stored, session_id, bool(missing))
        return stored, missing

    def _cleanup_push_session(self: Any, session_id: str, *, cleanup_messages: bool) -> None:
        end_session(self, session_id, cleanup_messages=cleanup_messages)
        ended = getattr(calls, "ended", None)
        if ended is None:
            arrivals.session_ended(session_id)
        else:
            ended.append(session_id)

    def store_object_then_announce(self: Any, *args: Any, **kwargs: Any) -> bool:
        outermost = getattr(calls, "ended", None) is None
        if outermost:
            calls.ended = []
        try:
            return bool(store_object(self, *args, **kwargs))
        finally:
            if outermost:
                ended, calls.ended = calls.ended, None
                for session_id in ended:
                    arrivals.session_ended(session_id)

    state_class.store_message_and_object_tree = store_message_and_object_tree
    state_class._cleanup_push_session = _cleanup_push_session
    state_class.store_object = store_object_then_announce


def hold_empty_pulls(servicer_class: Any, arrivals: Arrivals, hold: float) -> None:
    """Make ``servicer_class.PullMessages`` (the SuperNodes' Fleet API) wait up to ``hold`` s
    for complete work instead of answering "nothing", or a half-pushed instruction, at once."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse  # pylint: disable=E0611

    pull = servicer_class.PullMessages

    def PullMessages(self: Any, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        node_id = request.node.node_id
        deadline = time.monotonic() + hold
        ended, answered = threading.Event(), threading.Event()

        def call_ended() -> None:  # gRPC calls it when the call ends, answered or not
            ended.set()
            if not answered.is_set():  # only a call still waiting needs the waiters woken
                arrivals.wake_all()

        context.add_callback(call_ended)
        try:
            while True:
                seen = arrivals.seen(node_id)
                left = deadline - time.monotonic()
                # A half-pushed instruction pulled now would make the SuperNode back off a
                # second on its first missing object: wait for the rest (at most the hold).
                response = (pull(self, request, context) if left <= 0 else
                            arrivals.pull_if_none_half_pushed(
                                node_id, lambda: pull(self, request, context)))
                if response is not None and (response.messages_list or left <= 0):
                    return response
                arrivals.wait_for_node(node_id, seen, left, ended.is_set)
                if ended.is_set():  # nobody to deliver to: leave the message for the next poll
                    return PullMessagesResponse()
        finally:
            answered.set()

    servicer_class.PullMessages = PullMessages


def hold_reply_pulls(handlers: Any, arrivals: Arrivals, hold: float) -> None:
    """Make the ServerApp's ``pull_messages`` (Runtime API) hand over only replies stored
    with all their objects (Flower's ServerApp backs off a second on a half-pushed one) and,
    when none is ready, wait up to ``hold`` s for one."""
    pull = handlers.pull_messages

    def pull_messages(request: Any, state: Any, task: Any) -> Any:
        deadline = time.monotonic() + hold
        def pull_these(instruction_ids: list[str]) -> Any:
            ready = type(request)()
            ready.CopyFrom(request)
            del ready.message_ids[:]
            ready.message_ids.extend(instruction_ids)
            return pull(ready, state, task)

        while True:
            seen, response = arrivals.pull_complete_replies(list(request.message_ids),
                                                            pull_these)
            left = deadline - time.monotonic()
            if response.messages_list or left <= 0:
                return response
            arrivals.wait_for_replies(seen, left)

    handlers.pull_messages = pull_messages


def activation_refusal(state: Any, public_key: bytes, now: float) -> str:
    """Why a SuperNode with ``public_key`` cannot be activated, in words for its operator."""
    node_id = state.get_node_id_by_public_key(public_key)
    if node_id is None:
        return (f"{KEY_NOT_REGISTERED} (or it was unregistered): its operator registers the "
                "silo's .pub file (`dpcfl server --register`, `flwr supernode register`)")
    info = list(state.get_node_info(node_ids=[node_id]))
    if info and info[0].status == "online":
        left = max(0.0, info[0].online_until - now)
        return (f"{NODE_ONLINE} (node {node_id}): this silo runs elsewhere too, or its "
                f"previous session, if it ended without a goodbye, expires in {left:.0f} s")
    return f"node {node_id} of this public key is {info[0].status if info else 'unknown'}"


def explain_refused_activations(servicer_class: Any) -> None:
    """Make ``servicer_class.ActivateNode`` (the Fleet API) tell a refused SuperNode why:
    its key is not registered, or a node with its key is online (and for how long)."""
    from flwr.supercore.error import ApiErrorCode, FlowerError

    activate = servicer_class.ActivateNode

    def ActivateNode(self: Any, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        try:
            return activate(self, request, context)
        except FlowerError as error:
            if error.code == ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED:
                error.public_details = activation_refusal(
                    self.state_factory.state(), request.public_key, time.time())
            raise

    servicer_class.ActivateNode = ActivateNode


def patient_launches(memory_class: Any, sql_class: Any, grace: float) -> None:
    """Make ``claim_task`` of Flower's in-memory and SQL state classes give the claimed task
    ``grace`` seconds to be activated (Flower's activation then sets its own deadline)."""
    from datetime import timedelta

    from flwr.supercore.date import now
    from flwr.supercore.state.schema.corestate_models import Task as TaskModel
    from flwr.supercore.utils import uint64_to_int64
    from sqlalchemy import update

    def in_memory(self: Any, task_id: int, token: str) -> None:
        with self.lock_task_store:
            record = self.task_token_store.get(task_id)
            if record is not None and record.token == token:
                record.active_until = now() + timedelta(seconds=grace)

    def in_sql(self: Any, task_id: int, token: str) -> None:
        with self.session() as session:
            session.execute(update(TaskModel)
                            .where(TaskModel.task_id == uint64_to_int64(task_id),
                                   TaskModel.token == token, TaskModel.running_at.is_(None))
                            .values(active_until=now() + timedelta(seconds=grace)))

    for state_class, extend in ((memory_class, in_memory), (sql_class, in_sql)):
        def claim_task(self: Any, task_id: int, _claim: Any = state_class.claim_task,
                       _extend: Callable[[Any, int, str], None] = extend) -> str | None:
            token = _claim(self, task_id)
            if token is not None:
                _extend(self, task_id, token)
            return token

        state_class.claim_task = claim_task


def patient_sqlite(mixin_module: Any, busy_ms: int) -> None:
    """Make the SQLite connections of Flower's states (``mixin_module``: Flower's
    ``sql_mixin``, whose connect hook reads its ``SQLITE_PRAGMAS``) wait ``busy_ms`` for a
    lock."""
    mixin_module.SQLITE_PRAGMAS = tuple(
        (pragma, str(busy_ms) if pragma == "busy_timeout" else value)
        for pragma, value in mixin_module.SQLITE_PRAGMAS)


def install(hold: float, reply_hold: float) -> bool:
    """Patch Flower's SuperLink: whether idle polls are held (False with the tuning off,
    where nothing is changed, and with ``hold`` 0, where only refused activations are
    explained, launches and SQLite locks get their patience and ended sessions' messages
    their error replies)."""
    from . import gate

    if not gate.TUNING:
        return False
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.fleet.grpc_rere.fleet_servicer import FleetServicer
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore import sql_mixin
    from flwr.superlink.servicer.runtime import runtime_handlers

    from . import ended_sessions

    explain_refused_activations(FleetServicer)
    ended_sessions.install()
    patient_launches(InMemoryLinkState, SqlLinkState, LAUNCH_GRACE)
    patient_sqlite(sql_mixin, SQLITE_BUSY_MS)
    if hold <= 0:
        return False
    arrivals = Arrivals()
    for state_class in (InMemoryLinkState, SqlLinkState):
        announce_complete_messages(state_class, arrivals, SUPERLINK_NODE_ID)
    hold_empty_pulls(FleetServicer, arrivals, hold)
    hold_reply_pulls(runtime_handlers, arrivals, reply_hold)
    return True



def run_superlink(flower_arguments: Sequence[str], pull_hold: float) -> None:
    """Run ``flower-superlink <flower_arguments>`` in this process with the patches above
    (``pull_hold``: the longest wait of an empty SuperNode poll, s; 0 answers at once).
    Returns or raises SystemExit as Flower's SuperLink does."""
    from flwr.superlink.cli import flower_superlink

    from . import control_middleware, fleet_batches, gate, runtime_fast_path

    if install(pull_hold, REPLY_HOLD):
        print(f"dpcfl: the SuperLink holds an empty SuperNode poll up to "
              f"{pull_hold:g} s until work arrives", file=sys.stderr, flush=True)
    else:
        print(f"dpcfl: SuperNode polls are answered at once (--pull-hold {pull_hold:g})",
              file=sys.stderr, flush=True)
    if control_middleware.install():
        print("dpcfl: Runtime API requests skip the Control API's middleware",
              file=sys.stderr, flush=True)
    if runtime_fast_path.install():
        print("dpcfl: the ServerApp's object requests skip FastAPI's routing",
              file=sys.stderr, flush=True)
    if gate.TUNING and fleet_batches.serve(
            importlib.import_module("flwr.superlink.cli.flower_superlink")):
        print("dpcfl: SuperNodes may pull and push a message's objects in one call",
              file=sys.stderr, flush=True)
    sys.argv = ["flower-superlink", *flower_arguments]
    flower_superlink()


__all__ = ["LAUNCH_GRACE", "REPLY_HOLD", "SQLITE_BUSY_MS", "Arrivals", "activation_refusal",
           "announce_complete_messages", "explain_refused_activations", "hold_empty_pulls",
           "hold_reply_pulls", "install", "patient_launches", "patient_sqlite",
           "run_superlink"]
