"""An in-memory Grid for driving a strategy message by message in tests.

It stands in for the SuperLink only: every pushed message is recorded and answered at once by
a responder per node (scripted replies, or a real ClientApp with its own Context). Tests that
need Flower's own engine run the real simulation instead (test_simulation.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.serverapp import Grid

Responder = Callable[[Message], Message]


class GridDouble(Grid):
    def __init__(self, responders: dict[int, Responder]) -> None:
        self.responders = responders
        self.sent: list[Message] = []
        self._replies: dict[str, Message] = {}

    def set_run(self, run) -> None:  # not used: the double serves one run
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs) -> Message:  # deprecated in Flower
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.responders)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            # What Flower's grids do on push: give the message its id.
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node in self.responders:
                self._replies[message.metadata.message_id] = self.responders[node](message)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def of_type(self, message_type: str) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type == message_type]
