"""A message pulled by a silo whose session then ended gets an error reply at once, so the
round goes on without that silo instead of waiting for its round timeout.

When a SuperNode pulls a message, the SuperLink marks it delivered and never hands it out
again. A SuperNode that dies before it replies takes the message with it: its successor
starts with an empty state. Flower 1.39 covers a silo that stays away: while a node is
offline, the ServerApp's request for that node's replies gets a ``NODE_UNAVAILABLE`` error,
and the strategy counts the silo as dropped for the round. A silo that comes back at once is
not covered. ``dpcfl client`` restarts a silo's SuperNode within seconds, and that SuperNode
ends its stale session itself (:class:`.supernode.SessionMemory`), so the node is online
again before the ServerApp's next poll. Measured under docker compose, with a silo killed
mid-round and restarted 5 s later: the silo rejoined 8 s after the kill, and the round it
had pulled waited on (``round-timeout``, an hour by default).

The SuperLink can tell when this happened. It activates a node only from "registered" or
"offline", so at an activation every message delivered to that node and still unanswered
was pulled by a session that has ended, and no reply will come for it. :func:`install`
patches Flower's link states (in memory and SQL). At each successful activation they note
those messages (:class:`EndedSessions`). When the ServerApp next asks for their replies,
each gets an error reply with Flower's ``NODE_UNAVAILABLE`` code (the same code as for an
offline node) and a reason that says what happened. The silo's new session takes part
from the next round.

The noted messages are kept in this process's memory. A SuperLink that restarts between
the activation and the ServerApp's next request forgets them, and such a round again waits
for its timeout. A restart of the SuperLink alone loses nothing: the SuperNodes keep their
messages and reply once it is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

#: The reason an ended session's message gets as its error reply (the ServerApp logs it as
#: the silo's failure for that round).
SESSION_ENDED = ("the silo's session ended before it replied (its SuperNode stopped or was "
                 "restarted with this message in hand); it takes part again from the next "
                 "round")


class EndedSessions:
    """Messages delivered to sessions that have ended, by message id, until the ServerApp
    asks for their replies. Thread-safe: activations and the ServerApp's polls are served
    by different threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: dict[str, Any] = {}  # message id -> the message (flwr Message)

    def note(self, messages: Iterable[Any], now: float | None = None) -> None:
        """Record ``messages`` (delivered, unanswered, their session ended), and forget the
        recorded ones whose time to live has run out (the ServerApp no longer waits for
        them, and Flower answers an expired message itself): what is kept stays bounded by
        the messages in flight."""
        current = time.time() if now is None else now
        with self._lock:
            for message in messages:
                self._lost[message.metadata.message_id] = message
            for message_id, message in list(self._lost.items()):
                if message.metadata.created_at + message.metadata.ttl < current:
                    del self._lost[message_id]

    def take(self, message_ids: Iterable[str]) -> list[Any]:
        """The recorded messages among ``message_ids``, forgotten from here on."""
        with self._lock:
            return [m for i in message_ids if (m := self._lost.pop(i, None)) is not None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._lost)


def error_reply(instruction: Any, reason: str = SESSION_ENDED) -> Any:
    """The reply the SuperLink gives in the name of ``instruction``'s silo: no content,
    an error with Flower's ``NODE_UNAVAILABLE`` code and ``reason``. Addressed the way
    Flower's own generated replies are (from and to the SuperLink, the instruction's run,
    group and type, the rest of its time to live)."""
    from flwr.app import Error, Metadata
    from flwr.app.message import make_message
    from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
    from flwr.supercore.date import now

    asked = instruction.metadata
    current = now().timestamp()
    metadata = Metadata(
        run_id=asked.run_id, message_id="", src_node_id=SUPERLINK_NODE_ID,
        dst_node_id=SUPERLINK_NODE_ID, reply_to_message_id=asked.message_id,
        group_id=asked.group_id, message_type=asked.message_type, created_at=current,
        ttl=max(asked.ttl - (current - asked.created_at), 0.0),
        src_task_id=asked.dst_task_id, dst_task_id=asked.src_task_id)
    reply = make_message(metadata=metadata,
                         error=Error(code=ErrorCode.NODE_UNAVAILABLE, reason=reason))
    reply.metadata.__dict__["_message_id"] = reply.object_id  # as Flower names its own
    return reply


def unanswered_in_memory(state: Any, node_id: int) -> list[Any]:
    """Messages Flower's in-memory link state delivered to ``node_id`` without a reply."""
    with state.lock:
        return [m for i, m in state.message_ins_store.items()
                if m.metadata.dst_node_id == node_id and m.metadata.delivered_at
                and i not in state.message_ins_id_to_message_res_id]


def unanswered_in_sql(state: Any, node_id: int) -> list[Any]:
    """Messages Flower's SQL link state delivered to ``node_id`` without a reply."""
    from flwr.server.superlink.linkstate.sql_linkstate import _message_model_to_dict
    from flwr.server.superlink.linkstate.utils import (
        convert_sint64_values_in_dict_to_uint64,
        dict_to_message,
    )
    from flwr.supercore.state.schema.linkstate_models import MessageIns, MessageRes
    from flwr.supercore.utils import uint64_to_int64
    from sqlalchemy import select

    answered = select(MessageRes.reply_to_message_id)
    query = select(MessageIns).where(MessageIns.dst_node_id == uint64_to_int64(node_id),
                                     MessageIns.delivered_at != "",
                                     MessageIns.message_id.not_in(answered))
    with state.session() as session:
        rows = [_message_model_to_dict(model) for model in session.scalars(query).all()]
    for row in rows:
        convert_sint64_values_in_dict_to_uint64(row, ["run_id", "src_node_id", "dst_node_id"])
    return [dict_to_message(row) for row in rows]


def answer_ended_sessions(state_class: Any, ended: EndedSessions,
                          unanswered: Callable[[Any, int], list[Any]]) -> None:
    """Patch ``state_class`` (a Flower link state): a successful ``activate_node`` notes in
    ``ended`` what ``unanswered`` finds for that node, and ``get_message_res`` adds an error
    reply (:func:`error_reply`) for each noted message the ServerApp asks about and Flower
    had no reply for."""
    activate = state_class.activate_node
    get_replies = state_class.get_message_res

    def activate_node(self: Any, node_id: int, heartbeat_interval: float) -> bool:
        activated = bool(activate(self, node_id, heartbeat_interval))
        if activated:
            ended.note(unanswered(self, node_id))
        return activated

    def get_message_res(self: Any, message_ids: set[str], run_id: int) -> list[Any]:
        asked = set(message_ids)  # Flower removes ids from the set it is given
        replies = list(get_replies(self, message_ids, run_id))
        if not len(ended):
            return replies
        answered = {reply.metadata.reply_to_message_id for reply in replies}
        for instruction in ended.take(asked - answered):
            reply = error_reply(instruction)
            self._store_generated_message(reply)  # its objects, as Flower's own errors
            replies.append(reply)
        return replies

    state_class.activate_node = activate_node
    state_class.get_message_res = get_message_res


def install() -> EndedSessions:
    """Patch Flower 1.39's in-memory and SQL link states (see the module's text); returns
    the record both share."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    ended = EndedSessions()
    answer_ended_sessions(InMemoryLinkState, ended, unanswered_in_memory)
    answer_ended_sessions(SqlLinkState, ended, unanswered_in_sql)
    return ended


__all__ = ["SESSION_ENDED", "EndedSessions", "answer_ended_sessions", "error_reply", "install",
           "unanswered_in_memory", "unanswered_in_sql"]
