"""A silo's ClientApp answered inside its SuperNode's process, without the local HTTP hop.

Flower 1.39's SuperNode serves its ClientApp runtime over a local HTTP API (FastAPI/uvicorn):
every message costs the runtime ~15 requests (task, context, FAB, each object of the message
and of the reply, heartbeats, status), and on the quick example over gRPC the serving side took
more than half of a SuperNode's CPU and the runtime's HTTP client most of its time outside the
ClientApp (bench/RESULTS.md, "Framework overhead"). When the ClientApp runs in the SuperNode's
own process, the same Runtime API handlers Flower's router calls (``runtime_handlers``, on the
SuperNode's own ``NodeState``) can be called directly: the same task acquisition, the same
objects and statuses, minus HTTP, JSON-free protobuf round trips and a second process.

:class:`DirectRuntimeClient` has the methods of Flower's ``RuntimeHttpClient`` that a ClientApp
task uses, so Flower's own task I/O (``pull_task_input``, ``push_message``,
``push_task_output``) runs on it unchanged. A task token is still required and checked against
the state, as the HTTP router does.

One thing differs from the HTTP API: the task input comes with the run's FAB reduced to its
hash and verifications, without its content. The warm runtime never reads a task's FAB: it
judged the FAB from the SuperNode's state before the task ran (:func:`fab_check`), and copying
the ~1 MB FAB into every task input and out again took about half of the runtime's CPU per
message (5 of 11 ms). A runtime without that check would judge the empty FAB and refuse it.
"""

# ruff: noqa: E402 - the gate's check runs before the internal imports

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

from .gate import require_pin

require_pin(__name__)  # the gate runs before the internal imports below

from flwr.clientapp import ClientApp
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    ConfirmMessageReceivedRequest,
    ConfirmMessageReceivedResponse,
    PullObjectRequest,
    PullObjectResponse,
    PushObjectRequest,
    PushObjectResponse,
)
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    AcquireTaskResponse,
    PullAppMessagesRequest,
    PullAppMessagesResponse,
    PullTaskInputRequest,
    PullTaskInputResponse,
    PushAppMessagesRequest,
    PushAppMessagesResponse,
    PushTaskOutputRequest,
    PushTaskOutputResponse,
)
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.fab import Fab
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.nodestate import NodeState, NodeStateFactory
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState
from flwr.supernode.servicer.runtime import runtime_handlers as handlers

from .. import app_pin
from .warm_runtime import WOKEN_POLL_SECONDS, FabCheck, WarmRuntime

logger = logging.getLogger(__name__)


class DirectRuntimeClient:
    """The Runtime API of one SuperNode, called in its process (see module doc).

    Without a token it can only acquire tasks (what the SuperExec does); with one it acts for
    that task, which must exist in the state, as over HTTP.
    """

    def __init__(self, state_factory: NodeStateFactory, token: str | None = None) -> None:
        self._state_factory = state_factory
        self._token = token

    @property
    def _state(self) -> NodeState:
        return self._state_factory.state()

    def _held_task(self) -> Task | None:
        return self._state.get_task_by_token(self._token) if self._token else None

    def _task(self) -> Task:
        task = self._held_task()
        if task is None:
            raise FlowerError(ApiErrorCode.RUNTIME_AUTHENTICATION_FAILED,
                              "Runtime task-token authentication failed.")
        return task

    def AcquireTask(self, request: AcquireTaskRequest) -> AcquireTaskResponse:  # noqa: N802
        return handlers.acquire_task(request, self._state)

    def PullTaskInput(self, request: PullTaskInputRequest) -> PullTaskInputResponse:  # noqa: N802
        return handlers.pull_task_input(request, cast(NodeState, _FabsByHash(self._state)),
                                        self._task())

    def PushTaskOutput(  # noqa: N802
        self, request: PushTaskOutputRequest
    ) -> PushTaskOutputResponse:
        return handlers.push_task_output(request, self._state, self._task())

    def PullMessages(  # noqa: N802
        self, request: PullAppMessagesRequest
    ) -> PullAppMessagesResponse:
        return handlers.pull_messages(request, self._state, self._task())

    def PushMessages(  # noqa: N802
        self, request: PushAppMessagesRequest
    ) -> PushAppMessagesResponse:
        return handlers.push_messages(request, self._state, self._task())

    def PullObject(self, request: PullObjectRequest) -> PullObjectResponse:  # noqa: N802
        return handlers.pull_object(request, self._state, self._task())

    def PushObject(self, request: PushObjectRequest) -> PushObjectResponse:  # noqa: N802
        return handlers.push_object(request, self._state, self._task())

    def ConfirmMessageReceived(  # noqa: N802
        self, request: ConfirmMessageReceivedRequest
    ) -> ConfirmMessageReceivedResponse:
        return handlers.confirm_message_received(request, self._state, self._task())

    def task_heartbeat(self) -> bool:
        """The task's heartbeat. Flower's HTTP version raises SIGINT in its process when the
        SuperNode no longer knows the task, which here would stop the SuperNode itself: a lost
        task is only logged (its reply is then refused by the state)."""
        task = self._held_task()
        if task is None or not self._state.acknowledge_task_heartbeat(task.task_id):
            logger.warning("the SuperNode no longer holds this ClientApp task")
        return True

    def task_alive(self) -> bool:
        """Whether the SuperNode still waits for this task's reply: it holds the task and its
        message, and no message of another run is stored (the SuperNode takes one message at
        a time, so one behind it means this one's run was left unfinished)."""
        task = self._held_task()
        if task is None:
            return False
        # Flower 1.39's in-memory state, read under its lock: get_messages() would mark the
        # messages it returns as taken.
        state = cast(InMemoryNodeState, self._state)
        with state.lock_msg_store:
            runs = {entry.message.metadata.run_id for entry in state.msg_store.values()
                    if not entry.message.metadata.reply_to_message_id}
        return runs == {task.run_id}

    def close(self) -> None:
        """Nothing to release: no connection (the HTTP client's ``close`` counterpart)."""


class _FabsByHash:
    """A SuperNode's state whose FABs come without their content (see the module doc);
    everything else is the state's own."""

    def __init__(self, state: NodeState) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def get_fab(self, fab_hash: str) -> Fab | None:
        fab = self._state.get_fab(fab_hash)
        return None if fab is None else Fab(fab.hash_str, b"", dict(fab.verifications))


def direct_link(state_factory: NodeStateFactory) -> Callable[[str | None], RuntimeHttpClient]:
    """A client maker for :class:`~.warm_runtime.WarmRuntime`: token -> direct client (typed
    as the HTTP client whose methods it has, which is what Flower's task I/O expects)."""
    return lambda token: cast(RuntimeHttpClient, DirectRuntimeClient(state_factory, token))


#: Verdicts one SuperNode remembers (a run's FAB is judged at its first message); the oldest
#: is forgotten first, so runs with ever new FABs cannot grow the SuperNode's memory.
REMEMBERED_VERDICTS = 16


def fab_check(state_factory: NodeStateFactory) -> FabCheck:
    """For :class:`~.warm_runtime.WarmRuntime`: a task's FAB, read from the SuperNode's state
    without taking the task, and why it must not run here (None: it is the installed app,
    :mod:`dpcfl_flwr.app_pin`). A run or FAB the state does not hold raises (the task is
    refused).

    The verdict is a function of the FAB's bytes, the run's FAB id and version and the
    installed sources, so it is remembered by the FAB's own SHA-256 (computed here each time,
    not taken from the state) with that id and version: the FAB's files are unpacked and
    compared with the installed ones once per run, not at every message (~6 ms of CPU each
    for each of the quick example's 21 silos and rounds)."""
    verdicts: dict[tuple[str, str | None, str | None], str | None] = {}

    def check(task: Task) -> tuple[str, str | None]:
        state = state_factory.state()
        run = state.get_run(task.run_id)
        if run is None:
            raise LookupError(f"the SuperNode holds no run {task.run_id}")
        fab = state.get_fab(run.fab_hash)
        if fab is None:
            raise LookupError(f"the SuperNode holds no FAB {run.fab_hash}")
        digest = app_pin.fab_hash(fab.content)
        key = (digest, run.fab_id, run.fab_version)
        if key not in verdicts:
            while len(verdicts) >= REMEMBERED_VERDICTS:
                del verdicts[next(iter(verdicts))]
            verdicts[key] = app_pin.refusal(fab.content, run.fab_id, run.fab_version)
        return digest, verdicts[key]
    return check


def runtime_api_address(host: str, port: int) -> str:
    """Where a local process reaches the SuperNode's Runtime API bound to ``host``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: How much nicer (Linux scheduling niceness) than its SuperNode the thread running a silo's
#: ClientApp is, with the tuning on: see :func:`yield_to_the_supernode`.
CLIENTAPP_NICENESS = 10


def yield_to_the_supernode(niceness: int = CLIENTAPP_NICENESS) -> bool:
    """Make the calling thread ``niceness`` nicer than its process, on Linux (where niceness
    is a thread's); whether it was. The thread that trains yields the CPU to its SuperNode's
    threads, which pull and push messages, and to the processes of a SuperLink or ServerApp
    on the same machine: with silos sharing the cores (21 on 2 in the overhead benchmark),
    a round's first messages and last replies otherwise waited behind the training threads
    (a ServerApp took ~0.25 s to pull two replies while 19 silos trained). Training alone on
    a machine is not slowed: niceness only orders threads that want the same core."""
    if not sys.platform.startswith("linux"):  # elsewhere the call would name a process
        return False
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
    except OSError as exc:
        logger.debug("the ClientApp thread keeps its priority: %s", exc)
        return False
    return True


def serve_or_stop(runtime: WarmRuntime) -> None:
    """Serve until the process ends (with the tuning on, in a thread nicer than the
    SuperNode's: :func:`yield_to_the_supernode`); if serving fails, stop the SuperNode the
    graceful way (SIGTERM, it says goodbye to the SuperLink), as a silo's supervisor did when
    a separate runtime process died: a SuperNode that takes messages nobody answers would
    hold up every round until its timeout."""
    from . import gate

    if gate.TUNING:
        yield_to_the_supernode()
    try:
        runtime.serve()
    except Exception:  # noqa: BLE001 - reported, then the whole silo stops
        logger.exception("the ClientApp runtime failed; stopping the SuperNode")
        os.kill(os.getpid(), signal.SIGTERM)


def serve_in_supernode(cli: ModuleType, loop: ModuleType, load_app: Callable[[], ClientApp],
                       reply_stored: threading.Event, per_message: bool = False) -> None:
    """Make Flower's ``flower-supernode`` (modules ``cli`` and ``loop``) answer its ClientApp
    tasks from its own process, each only if its FAB is the app installed here.

    Once the SuperNode has its state and Runtime API, a daemon thread runs
    :class:`~.warm_runtime.WarmRuntime` on a :class:`DirectRuntimeClient`, with the FABs read
    from the SuperNode's state: warm, or with ``per_message`` a fresh ``flwr-clientapp`` per
    trusted task (which reaches the Runtime API over HTTP). It is woken as soon as the loop
    has stored a message, and sets ``reply_stored`` when a task is done, for the loop's reply
    wait (see :mod:`.supernode`).
    """
    start_api = getattr(cli, "_start_supernode_http_api")  # noqa: B009 - Flower 1.39's
    pull_and_store = getattr(loop, "_pull_and_store_message")  # noqa: B009

    def start_api_and_runtime(config: Any, state_factory: NodeStateFactory) -> Any:
        started = start_api(config, state_factory)
        runtime = WarmRuntime(runtime_api_address(config.host, config.port),
                              None if per_message else load_app(), WOKEN_POLL_SECONDS,
                              connect=direct_link(state_factory),
                              on_task_done=reply_stored.set,
                              check_fab=fab_check(state_factory), per_message=per_message)

        def pull_store_and_wake(*args: Any, **kwargs: Any) -> Any:
            run_id = pull_and_store(*args, **kwargs)
            if run_id is not None:
                runtime.wake.set()
            return run_id

        setattr(loop, "_pull_and_store_message", pull_store_and_wake)  # noqa: B010
        threading.Thread(target=serve_or_stop, args=(runtime,), name="dpcfl-clientapp",
                         daemon=True).start()
        logger.info("ClientApp tasks are answered %s, for FABs that ship the installed app only",
                    "by one flwr-clientapp process each" if per_message
                    else "in the SuperNode's process")
        return started

    setattr(cli, "_start_supernode_http_api", start_api_and_runtime)  # noqa: B010
