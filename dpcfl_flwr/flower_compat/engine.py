"""Three per-message costs of Flower 1.39's simulation engine that a short silo task notices,
and how a stopped simulation keeps Ray from replacing its signal handling.

A silo's task in the quick example is ~0.3 s of training, and 21 of them share 2 Ray workers,
so a few milliseconds per hand-over and a tenth of a second per round are several percent of
a round (bench/RESULTS.md, "Where the simulation's overhead goes"):

- Ray passes a task argument or result larger than 100 KB through its shared-memory object
  store instead of inside the task: a round trip to the raylet per message. One CNN model is
  116 KB, so every task went that way; the hand-over between two tasks of a worker took
  ~11 ms and takes ~6 ms with messages up to :data:`INLINE_BYTES` inline.
- The engine's dispatcher looks for new messages every 0.1 s (``add_messages_to_queue`` in
  ``flwr/server/superlink/fleet/vce/vce_api.py``), so a round's first task starts 0-100 ms
  after the ServerApp pushed it while both workers wait, and its scan runs ten times a second
  all run long. The scan asks every node for a message (``get_message_ins``), and each ask
  walks every stored message, so one scan costs silos x messages checks: 0.26 s of CPU at
  210 silos and 7 s at 1,008, in the process that also runs the ServerApp.
  :func:`woken_dispatch` hands out each message as it is stored, the way the engine's own
  loop would with no delay, at one check per message.
- The ServerApp learns of a reply by polling the grid (every 50 ms in simulation,
  ``strategies/exchange.py``), so the round's last reply waited 25 ms on average while both
  workers sat idle. While the woken dispatcher runs, :func:`wait_for_replies` returns as soon
  as the engine stores a reply (:func:`replies_wake_waits` says whether a grid's do), so the
  ServerApp needs no timer to learn of one.

Imported only through :mod:`dpcfl_flwr.flower_compat` once its version gate said yes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from queue import Queue
from typing import Any

# Above the largest message of the quick example (a selection round's four CNN models, ~0.5 MB)
# and far below Ray's 10 MB limit on a task's inlined arguments; larger models (ResNet-18:
# 45 MB) still go through the object store.
INLINE_BYTES = 2 * 2**20
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": INLINE_BYTES}

FALLBACK_SCAN_SECONDS = 1.0  # how often the dispatcher sweeps the state, and notices a stop

# The link state of each running woken dispatcher (by id) -> set when a reply is stored.
_reply_stored: dict[int, threading.Event] = {}


def _set_after(state: Any, method_name: str, event: threading.Event,
               on_result: Callable[[Any], None] | None = None) -> None:
    """Make ``state.<method_name>`` set ``event`` after each call (this object only), first
    handing ``on_result`` the call's result."""
    method: Callable[..., Any] = getattr(state, method_name)

    def call_and_set(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        if on_result is not None:
            on_result(result)
        event.set()
        return result

    setattr(state, method_name, call_and_set)


class _StoredIds:
    """The ids of the messages stored since the dispatcher last took them, in order."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._lock = threading.Lock()

    def note_stored(self, message_id: Any) -> None:
        """``store_message_ins``' result: the message's id, or None if it was refused."""
        if message_id is not None:
            with self._lock:
                self._ids.append(str(message_id))

    def take(self) -> list[str]:
        with self._lock:
            ids, self._ids = self._ids, []
        return ids


def _dispatch_when_stored(state: Any, queue: Queue[Any], nodes_mapping: Any,
                          f_stop: threading.Event) -> None:
    """Flower's dispatcher loop, woken by ``store_message_ins`` instead of a 0.1 s timer,
    handing out the messages stored since it last looked (:func:`_deliver`) instead of asking
    every node for one. Every :data:`FALLBACK_SCAN_SECONDS` it also sweeps the state for a
    message not yet handed out, in case one was stored some other way."""
    stored = threading.Event()
    stored_ids = _StoredIds()
    _set_after(state, "store_message_ins", stored, stored_ids.note_stored)
    _set_after(state, "store_message_res", _reply_stored.setdefault(id(state),
                                                                   threading.Event()))
    nodes = set(nodes_mapping)
    next_sweep = 0.0
    try:
        while not f_stop.is_set():
            stored.clear()  # before the look: a message stored during it wakes the next one
            message_ids = stored_ids.take()
            if time.monotonic() >= next_sweep:
                message_ids += _undelivered(state)
                next_sweep = time.monotonic() + FALLBACK_SCAN_SECONDS
            for message_id in message_ids:
                message = _deliver(state, message_id, nodes)
                if message is not None:
                    queue.put(message)
            stored.wait(max(0.0, next_sweep - time.monotonic()))
    finally:
        del state.store_message_ins, state.store_message_res
        _reply_stored.pop(id(state), None)


def _undelivered(state: Any) -> list[str]:
    """The ids of the state's messages not handed out yet, in the order they were stored."""
    with state.lock:
        return [message_id for message_id, message in state.message_ins_store.items()
                if message.metadata.delivered_at == ""]


def _deliver(state: Any, message_id: str, nodes: set[int]) -> Any:
    """The stored message ``message_id``, marked delivered, if it is still to hand out to one
    of ``nodes``; else None. What Flower's ``get_message_ins`` does for a node's message, for
    one message: its own check first (an expired message, or one between nodes no longer in
    one federation, is deleted), then the delivery mark. Flower's walks every stored message
    to find a node's, so asking each of n nodes costs n^2 checks: 7 s of CPU a scan at 1,008
    silos."""
    with state.lock:
        state._check_stored_messages({message_id})
        message = state.message_ins_store.get(message_id)
        if (message is None or message.metadata.delivered_at != ""
                or message.metadata.dst_node_id not in nodes):
            return None
        message.metadata.delivered_at = _now_iso()
        return message


def _now_iso() -> str:
    """The delivery time as Flower's link state writes it."""
    from flwr.supercore.date import now

    return now().isoformat()


def wait_for_replies(grid: Any, seconds: float) -> None:
    """Wait ``seconds``, or less if the grid's engine stores a reply meanwhile.

    Only a grid on the state of a running woken dispatcher is woken early (Flower's in-memory
    grid in simulation); any other grid, a deployment's included, just sleeps."""
    replied = _reply_event(grid)
    if replied is None:
        time.sleep(seconds)
        return
    replied.wait(seconds)
    replied.clear()  # the caller pulls next, so a reply stored from here on is not missed


def replies_wake_waits(grid: Any) -> bool:
    """Whether :func:`wait_for_replies` on ``grid`` ends when the engine stores a reply
    (the grid is on the state of a running woken dispatcher)."""
    return _reply_event(grid) is not None


def _reply_event(grid: Any) -> threading.Event | None:
    """The event a stored reply sets on ``grid``'s state, if a woken dispatcher serves it."""
    return _reply_stored.get(id(getattr(grid, "state", None)))


def is_in_memory_grid(grid: Any) -> bool:
    """Whether ``grid`` is Flower's in-memory grid (the simulation engine's)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def flower_array_chunk_size() -> int:
    """Flower's largest array chunk in bytes (its private constant)."""
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    return int(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)


def run_tuned_simulation(*, num_supernodes: int, server_app: str, client_app: str,
                         run_config: Mapping[str, Any], backend_config: dict[str, Any],
                         app_dir: str, verbose: bool) -> None:
    """Flower's private simulation entry point (the public one passes no run config, and no
    app directory whose ``[tool.flwr.app.config]`` every virtual SuperNode reads), with Ray's
    inline messages and the woken dispatcher."""
    from flwr.app import Context, RecordDict
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    backend = {**backend_config, "init_args": {**backend_config.get("init_args", {}),
                                               "_system_config": RAY_SYSTEM_CONFIG}}
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(run_config))
    with woken_dispatch():
        _run_simulation(
            num_supernodes=num_supernodes,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
            server_app_attr=server_app, client_app_attr=client_app,
            backend_name="ray", backend_config=backend, app_dir=app_dir, is_app=True,
            server_app_context=context, verbose_logging=verbose,
        )


@contextmanager
def woken_dispatch() -> Iterator[None]:
    """Use :func:`_dispatch_when_stored` as the engine's dispatcher while the block runs."""
    from flwr.server.superlink.fleet.vce import vce_api

    flowers_own = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = _dispatch_when_stored
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = flowers_own


@contextmanager
def signals_left_to_us() -> Iterator[None]:
    """Keep ``ray.init`` from replacing the SIGTERM handler of this process while the block
    runs. Ray's raises SystemExit in the main thread, wherever Flower's engine loop is, so
    Flower's worker threads log every running task's ActorDiedError; the caller's handler
    stops the ServerApp and lets Flower shut Ray down (``dpcfl_flwr/runs/simulation.py``)."""
    import ray._private.utils as ray_utils

    rays_own = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = rays_own


__all__ = ["INLINE_BYTES", "RAY_SYSTEM_CONFIG", "flower_array_chunk_size", "is_in_memory_grid",
           "replies_wake_waits", "run_tuned_simulation", "signals_left_to_us",
           "wait_for_replies", "woken_dispatch"]
