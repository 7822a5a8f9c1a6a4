"""Moving a round's messages through Flower's Grid: push, then poll for the replies.

:class:`PollingGrid` wraps the run's grid (public ``Grid`` API only) so that Flower's own
round loop (``Strategy.start``, whose ``send_and_receive`` calls land here) gets the fast
polling described below instead of Flower's fixed 3 s wait.

Flower 1.39's ``Grid.send_and_receive`` sleeps 3 s between polls over the SuperLink's HTTP
runtime API, so every round it drives costs at least 3 s; polling ``pull_messages`` every
50 ms gave ~0.1 s of framework latency per round for 21 clients. But over a deployment each
poll is an HTTPS request the SuperLink serves in Python, and 20 a second for a whole round
is CPU the silos on a shared machine do not get (bench/RESULTS.md, "by process role"). So the
wait backs off while nothing arrives (x1.5 up to 0.5 s) and drops back to 50 ms as soon as a
reply comes in: replies that trickle in are still collected within ~50 ms, and a silent
stretch costs a poll every half second. In Flower's simulation engine the grid is in the
same process and the wait ends when the engine stores a reply
(``flower_compat.wait_for_replies``), so the ServerApp polls once a reply is there and every
half second otherwise. A poll there walks every pending message of the engine (~10 ms at
1,000 silos), so one poll per reply would be seconds of the ServerApp's CPU in a 1,008-silo
round, beside the silos; such polls keep at least 50 ms and 20x their own time apart
(:func:`poll_spacing`). Without that wake-up (another Flower) it polls every 50 ms. A round's
messages go in one push (one request and one object session instead of one per silo); the
grid gives each message its id, which maps it back to its silo even when some are refused.

Every wait of the ServerApp goes through this module's polls, so they are where an operator's
Ctrl-C takes effect: ``dpcfl simulate`` sets :data:`stop_requested` and the next poll raises
:class:`RunInterrupted`, which ends the ServerApp and with it Flower's engine.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from ..flower_compat import in_process_grid, replies_wake_waits, wait_for_replies

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # the wait after a poll that brought a reply
MAX_POLL_SECONDS = 0.5  # the longest wait between polls
BACKOFF = 1.5
POLL_CPU_SHARE = 0.05  # the largest share of the ServerApp's time its woken polls may take

#: Set to stop the ServerApp of this process at its next poll (``dpcfl simulate``'s Ctrl-C).
stop_requested = threading.Event()


class RunInterrupted(RuntimeError):
    """The operator stopped the run: the ServerApp ends instead of waiting on. ``status``:
    the exit status that says so (128 + the signal, as a shell reports it)."""

    def __init__(self, message: str, status: int = 128 + signal.SIGINT) -> None:
        super().__init__(message)
        self.status = status


def check_stop() -> None:
    """Raise :class:`RunInterrupted` once a stop was requested."""
    if stop_requested.is_set():
        raise RunInterrupted("the run was stopped (Ctrl-C); no silo is asked for more work")


def pause(seconds: float) -> None:
    """Sleep ``seconds``, or raise :class:`RunInterrupted` as soon as a stop is requested."""
    stop_requested.wait(seconds)
    check_stop()


def longest_poll(grid: Grid) -> float:
    """How far the wait may grow: an in-process grid whose waits no stored reply ends is
    polled at the short period, as a poll there costs little and a reply must not wait."""
    if in_process_grid(grid) and not replies_wake_waits(grid):
        return POLL_SECONDS
    return MAX_POLL_SECONDS


def poll_spacing(poll_seconds: float) -> float:
    """The least time from one poll's start to the next when a stored reply wakes the wait:
    POLL_SECONDS, or longer if a poll itself took over :data:`POLL_CPU_SHARE` of that. A poll
    of Flower's in-memory grid walks every pending message (~10 ms at 1,000 silos), so one
    poll per reply would take seconds of a round's CPU there, beside the silos."""
    return max(POLL_SECONDS, poll_seconds / POLL_CPU_SHARE)


def next_poll_delay(previous: float, got_reply: bool, ceiling: float = MAX_POLL_SECONDS
                    ) -> float:
    """The wait before the next poll: short while replies are arriving, growing while none."""
    if got_reply:
        return POLL_SECONDS
    return min(ceiling, previous * BACKOFF)


@dataclass
class Exchange:
    """Replies by silo key, and the silos that sent nothing back in time."""

    replies: dict[int, Message] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    seconds: float = 0.0


def exchange(
    grid: Grid, messages: Mapping[int, Message], timeout: float,
    on_reply: Callable[[int, Message], None] | None = None,
) -> Exchange:
    """Send ``messages`` (keyed by silo) and wait up to ``timeout`` s for all replies."""
    if isinstance(grid, PollingGrid):  # poll the grid itself: its kind sets the waits
        grid = grid.grid
    check_stop()
    started = time.monotonic()
    pending: dict[str, int] = {}
    result = Exchange()
    pushed = {i for i in grid.push_messages(list(messages.values())) if i}
    for key, message in messages.items():
        if message.metadata.message_id in pushed:  # the grid gave it its id on the push
            pending[message.metadata.message_id] = key
        else:
            logger.warning("could not push a message to silo %s", key)
            result.missing.append(key)
    deadline = started + timeout
    delay, ceiling = POLL_SECONDS / BACKOFF, longest_poll(grid)  # first wait: 50 ms
    woken = replies_wake_waits(grid)  # a stored reply ends the wait: no short polls needed
    while pending:
        arrived = 0
        polled = time.monotonic()
        replies = grid.pull_messages(list(pending))
        poll_seconds = time.monotonic() - polled
        for reply in replies:
            if reply.metadata.reply_to_message_id not in pending:
                continue
            key = pending.pop(reply.metadata.reply_to_message_id)
            result.replies[key] = reply
            arrived += 1
            if on_reply is not None:
                on_reply(key, reply)
        if not pending or time.monotonic() >= deadline:
            break
        check_stop()
        if woken:  # the next reply ends the wait below: first leave the polls their spacing
            pause(max(0.0, min(polled + poll_spacing(poll_seconds) - time.monotonic(),
                               deadline - time.monotonic())))
        delay = ceiling if woken else next_poll_delay(delay, arrived > 0, ceiling)
        # Counted from the poll's start: a SuperLink that held an empty poll until a reply
        # was ready (deploy/superlink_launcher.py) has already waited.
        wait = delay - (time.monotonic() - polled)
        wait_for_replies(grid, max(0.0, min(wait, deadline - time.monotonic())))
    result.missing.extend(pending.values())
    result.seconds = time.monotonic() - started
    return result


class PollingGrid(Grid):
    """The run's grid, whose ``send_and_receive`` pushes a round's messages at once and polls
    with back-off (:func:`exchange`). Everything else is the wrapped grid's.

    ``grid``: the grid Flower gave the ServerApp (simulation's in-memory grid or the
    SuperLink's)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """The replies that arrived within ``timeout`` s (None: an hour); a message that got
        no reply in time has none in the list, as with Flower's own grids."""
        keyed = dict(enumerate(messages))
        if not keyed:
            return []
        done = exchange(self.grid, keyed, 3600.0 if timeout is None else timeout)
        return list(done.replies.values())
