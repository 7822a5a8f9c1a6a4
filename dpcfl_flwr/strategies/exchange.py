"""Moving a round's messages through Flower's Grid: push, then poll for the replies.

Flower 1.39's ``Grid.send_and_receive`` sleeps 3 s between polls over the SuperLink's HTTP
runtime API, so every round it drives costs at least 3 s; polling ``pull_messages`` every
50 ms gave ~0.1 s of framework latency per round for 21 clients. Messages are pushed one by one
so that every message id maps to its silo even when a push fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.serverapp import Grid

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


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
    started = time.monotonic()
    pending: dict[str, int] = {}
    result = Exchange()
    for key, message in messages.items():
        ids = [i for i in grid.push_messages([message]) if i]
        if ids:
            pending[ids[0]] = key
        else:
            logger.warning("could not push a message to silo %s", key)
            result.missing.append(key)
    deadline = started + timeout
    while pending:
        for reply in grid.pull_messages(list(pending)):
            if reply.metadata.reply_to_message_id not in pending:
                continue
            key = pending.pop(reply.metadata.reply_to_message_id)
            result.replies[key] = reply
            if on_reply is not None:
                on_reply(key, reply)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    result.missing.extend(pending.values())
    result.seconds = time.monotonic() - started
    return result
