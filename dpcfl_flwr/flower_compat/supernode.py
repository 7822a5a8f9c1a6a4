"""Flower 1.39's SuperNode with shorter waits, a rejoin after a crash, and its ClientApp
tasks answered in process: the internals behind ``deploy/supernode_launcher.py``.

Flower 1.39's SuperNode loop sleeps a fixed 3 s whenever a poll of the SuperLink brings no
message, and checks every 0.5 s whether its ClientApp has replied
(``flwr/supernode/start_client_internal.py``). A round therefore reaches an idle silo on
average 1.5 s late and its reply leaves up to 0.5 s late; on the quick example over gRPC the
shorter waits took about 1 s off each round (bench/RESULTS.md). :func:`run_supernode` runs
Flower's own SuperNode unchanged except for those two waits, which it shortens to
``idle_poll`` seconds and a tenth of it, but not below 0.1 s (a reply then leaves at most
0.1 s late; checking faster only adds turns of the SuperNode's locked state scan). The idle
wait counts from the previous poll's start: against a SuperLink that holds an empty poll until
work arrives (:mod:`.superlink`, what ``dpcfl server`` runs) the silo asks again at once,
against Flower's own SuperLink it polls every ``idle_poll`` seconds. Everything else (gRPC,
TLS, node authentication, retries) is Flower's code path. The waits are module-level
``time.sleep`` calls, so that module's ``time`` is swapped for one whose ``sleep`` maps
Flower's two constants.

The SuperNode's local Runtime API (uvicorn) ticks once a second instead of ten times, and its
gRPC channel goes without the connectivity subscription Flower makes only to log changes at
DEBUG (gRPC polls the channel five times a second for it): 21 idle silos' ticks and polls were
CPU that the training silos on the same cores did not get.

A silo restarted after a crash rejoins at once: the SuperNode keeps its open session's node
id in the Flower home and, finding it at the next start, ends that stale session itself
before it asks to be activated (:class:`SessionMemory`); Flower's SuperLink would otherwise
refuse it until the old session's heartbeat expires (~60 s).

A SuperLink that restarts without its state (``--in-memory``) no longer knows the silo's node
id, and the SuperNode's next heartbeat is refused ("Invalid node ID"), which ends Flower's
heartbeat thread. The SuperNode then stops gracefully, but its goodbye first stops that thread
and Flower raises because it is no longer running: the SuperNode exited 1, which its
supervisor reads as a failure and ends the silo, where it restarts a SuperNode that lost its
SuperLink (``deploy/silo_supervisor.py``). :func:`stop_after_a_failed_heartbeat` lets the
goodbye go on. That is not tuning: it applies whatever the gate says.

The rest of the above is latency tuning, applied only while the gate of
:mod:`dpcfl_flwr.flower_compat` is open. The app pin is not: the SuperNode always answers its
ClientApp tasks from its own process (:mod:`.direct_runtime`), for FABs that ship the installed
app only, and on a Flower release other than the supported one the launcher refuses to start
(``flower_compat.pin_supported``) rather than run a silo without the pin.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

FLOWER_IDLE_WAIT = 3.0  # seconds Flower sleeps after a poll that brought no message
FLOWER_REPLY_WAIT = 0.5  # seconds between its checks for the ClientApp's reply
MIN_REPLY_POLL = 0.1
RUNTIME_API_TICK = 1.0  # seconds; uvicorn's own: 0.1


class ShortWaits:
    """Stands in for the ``time`` module inside Flower's SuperNode loop: every attribute is
    the real one except ``sleep``, which shortens Flower's two fixed waits."""

    def __init__(self, idle_poll: float, reply_stored: threading.Event | None = None) -> None:
        if idle_poll <= 0:
            raise ValueError(f"idle poll must be positive, got {idle_poll}")
        self.idle_poll = idle_poll
        self.reply_poll = min(FLOWER_REPLY_WAIT, max(MIN_REPLY_POLL, idle_poll / 10))
        self.reply_stored = reply_stored
        self._idle_wait_ended = time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE_WAIT:
            # Polls start at most every idle_poll s: a SuperLink that held the empty poll
            # (:mod:`.superlink`) has already made the silo wait, so ask again now.
            since_last_wait = time.monotonic() - self._idle_wait_ended
            time.sleep(max(0.0, self.idle_poll - since_last_wait))
            self._idle_wait_ended = time.monotonic()
            return
        if seconds == FLOWER_REPLY_WAIT:
            if self.reply_stored is not None:  # an in-process ClientApp says when it is done
                self.reply_stored.wait(FLOWER_REPLY_WAIT)
                self.reply_stored.clear()
                return
            seconds = self.reply_poll
        time.sleep(seconds)

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def shorten_waits(loop: ModuleType, idle_poll: float,
                  reply_stored: threading.Event | None = None) -> bool:
    """Install :class:`ShortWaits` in Flower's SuperNode loop module; False (and nothing
    changed) when it was installed already."""
    if getattr(loop, "time", None) is not time:
        return False
    loop.time = ShortWaits(idle_poll, reply_stored)  # type: ignore[attr-defined]
    return True


def skip_connectivity_watch(connection: ModuleType) -> bool:
    """Leave out the SuperNode's subscription to its gRPC channel's connectivity; False
    (nothing changed) when the module makes no channel. Flower subscribes only to log each change
    at DEBUG, and gRPC serves a subscription with a thread that asks the channel for its state
    five times a second for the channel's whole life: with polls held by the SuperLink
    (:mod:`.superlink`), the largest part of an idle silo's CPU."""
    create = getattr(connection, "create_channel", None)
    if create is None:
        return False

    def create_channel(*args: Any, **kwargs: Any) -> Any:
        channel = create(*args, **kwargs)
        channel.subscribe = _no_subscription
        return channel

    connection.create_channel = create_channel  # type: ignore[attr-defined]
    return True


def _no_subscription(callback: Callable[..., object], try_to_connect: bool = False) -> None:
    """A channel's ``subscribe`` that subscribes nobody (see skip_connectivity_watch)."""


class SessionMemory:
    """A gRPC client interceptor that keeps this silo's open session in a file: the node id,
    written when the SuperLink activates the node, removed when the SuperNode deactivates it
    on its way out. A file found at the next activation means that the SuperNode before
    ended without that goodbye (killed, crashed, its machine lost), and the SuperLink would
    refuse the restarted silo until the old session expires (Flower 1.39: two missed 30 s
    heartbeats, ~60 s). The silo then ends that session itself (``DeactivateNode``, signed
    with its own key like every request; a SuperLink admits it for that key's node only)
    and is activated at once. Another instance of the silo elsewhere has no such file and is
    still refused while this one is connected."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.channel: Any = None  # the channel this interceptor is part of (set after)

    def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any],
                              call_details: Any, request: Any) -> Any:
        method = call_details.method.rsplit("/", 1)[-1]
        if method == "ActivateNode":
            self._end_previous_session()
        outcome = continuation(call_details, request)
        if outcome.exception() is None:
            with contextlib.suppress(OSError):  # unwritable: Flower's own wait after a crash
                if method == "ActivateNode":
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self.path.write_text(json.dumps({"node-id": outcome.result().node_id}))
                elif method == "DeactivateNode":
                    self.path.unlink(missing_ok=True)
        return outcome

    def _end_previous_session(self) -> None:
        import grpc
        from flwr.proto.fleet_pb2 import DeactivateNodeRequest  # pylint: disable=E0611
        from flwr.proto.fleet_pb2_grpc import FleetStub  # pylint: disable=E0611

        try:
            node_id = int(json.loads(self.path.read_text())["node-id"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        try:
            FleetStub(self.channel).DeactivateNode(DeactivateNodeRequest(node_id=node_id),
                                                   timeout=10)
        except grpc.RpcError:  # not open any more, or not this SuperLink's node: nothing to end
            return
        print(f"dpcfl: ended this silo's previous session (node {node_id}), left open by a "
              "SuperNode that did not say goodbye", file=sys.stderr, flush=True)


def remember_session(connection: ModuleType, path: Path) -> bool:
    """Give the SuperNode's gRPC channel a :class:`SessionMemory` keeping ``path``; False
    (nothing changed) when the module makes no channel."""
    import grpc

    create = getattr(connection, "create_channel", None)
    if create is None:
        return False

    class Memory(SessionMemory, grpc.UnaryUnaryClientInterceptor):  # grpc: only when used
        pass

    def create_channel(*args: Any, **kwargs: Any) -> Any:
        memory = Memory(path)
        kwargs["interceptors"] = [*(kwargs.get("interceptors") or ()), memory]
        memory.channel = create(*args, **kwargs)
        return memory.channel

    connection.create_channel = create_channel  # type: ignore[attr-defined]
    return True


def session_file(flower_arguments: Sequence[str], flower_home: Path) -> Path | None:
    """Where a silo keeps its open session (:class:`SessionMemory`): in the Flower home
    (``$FLWR_HOME``, ``~/.flwr``), one file per SuperLink address and node key; None without
    a node key (Flower then makes a new key, and a new node, at every start)."""
    options = dict(zip(flower_arguments, flower_arguments[1:], strict=False))
    key = options.get("--auth-supernode-private-key")
    if key is None:
        return None
    identity = f"{options.get('--superlink', '')} {Path(key).resolve()}".encode()
    return flower_home / "dpcfl-sessions" / f"{hashlib.sha256(identity).hexdigest()[:16]}.json"


def slow_runtime_api_tick(server_class: type, seconds: float = RUNTIME_API_TICK) -> bool:
    """Make uvicorn's housekeeping tick (10 Hz: exit flag, Date header) of the SuperNode's
    local Runtime API run every ``seconds``; False (nothing changed) when ``server_class`` is
    not the uvicorn ``Server`` we know. The tick only decides how soon the API notices that it
    should stop; requests are served by the event loop as they come."""
    if not callable(getattr(server_class, "on_tick", None)) or not hasattr(server_class,
                                                                           "main_loop"):
        return False

    async def main_loop(self: Any) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # a multiple of 10: uvicorn's "once a second"
            await asyncio.sleep(seconds)

    server_class.main_loop = main_loop
    return True



def stop_after_a_failed_heartbeat(sender_class: Any) -> None:
    """Make ``sender_class.stop`` (Flower's ``HeartbeatSender``) return where its thread has
    already ended, a heartbeat having raised, instead of raising RuntimeError."""
    stop = sender_class.stop

    def stop_even_if_ended(self: Any) -> None:
        if self._thread.is_alive():
            stop(self)
        else:
            self._stop_event.set()

    setattr(sender_class, "stop", stop_even_if_ended)  # noqa: B010


def run_supernode(flower_arguments: Sequence[str], idle_poll: float, per_message: bool,
                  load_app: Callable[[], ClientApp]) -> None:
    """Run ``flower-supernode --isolation process <flower_arguments>`` in this process,
    answering its tasks with :mod:`.direct_runtime` (``load_app`` gives the ClientApp, warm
    unless ``per_message``) and, with the tuning on, with the shortened waits (``idle_poll``
    seconds when idle), the slow Runtime API tick, no connectivity watch and the session
    memory. Returns or raises SystemExit as Flower's SuperNode does."""
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.utils import get_flwr_home
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.cli import flower_supernode

    from . import fleet_batches, gate
    from .direct_runtime import serve_in_supernode

    reply_stored = threading.Event()
    stop_after_a_failed_heartbeat(HeartbeatSender)
    if gate.TUNING:
        import uvicorn

        slow_runtime_api_tick(uvicorn.Server)
        connection = importlib.import_module("flwr.client.grpc_rere_client.connection")
        skip_connectivity_watch(connection)
        if (session := session_file(flower_arguments, get_flwr_home())) is not None:
            remember_session(connection, session)
        shorten_waits(loop, idle_poll, reply_stored)
        fleet_batches.install(connection, loop)
        print(f"dpcfl: SuperNode polls the SuperLink every {idle_poll:g} s when idle "
              f"(Flower's default: {FLOWER_IDLE_WAIT:g} s)", file=sys.stderr, flush=True)
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    serve_in_supernode(cli, loop, load_app, reply_stored, per_message=per_message)
    sys.argv = ["flower-supernode", "--isolation", "process", *flower_arguments]
    flower_supernode()


__all__ = ["FLOWER_IDLE_WAIT", "FLOWER_REPLY_WAIT", "SessionMemory", "ShortWaits",
           "remember_session", "run_supernode", "session_file", "shorten_waits",
           "skip_connectivity_watch", "slow_runtime_api_tick", "stop_after_a_failed_heartbeat"]
