"""Requests to a SuperLink's Runtime API as a ServerApp sends them, over Starlette's test
client, and Flower's app counting the ones that reach it (tests of the SuperLink's fast path
and of the ServerApp's object batches); a message stored in a link state as a push's first
request stores it (also for the SuperNodes' object batches), and a node's reply stored as its
SuperNode stores it."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.supercore.constant import TASK_TOKEN_HEADER
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.runtime_version_compatibility import RuntimeVersionMetadata

PROTOBUF = "application/protobuf"
SERVERAPP = dict(RuntimeVersionMetadata.from_local_component("ServerApp").as_metadata())
HERE = Node(node_id=SUPERLINK_NODE_ID)


class Counted:
    """Flower's app, counting the requests that reach it."""

    def __init__(self, app) -> None:
        self.app, self.state, self.paths = app, app.state, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def post(client, route: str, body: bytes, token: str | None, **headers: str):
    sent = {"content-type": PROTOBUF, **SERVERAPP, **headers}
    if token is not None:
        sent[TASK_TOKEN_HEADER] = token
    return client.post(f"/v1/runtime/{route}", content=body, headers=sent)


def stored_without_objects(state, run_id: int, message) -> tuple[str, list[str], dict]:
    """Store ``message`` in the link ``state`` with its object tree, as a push's first request
    does, in a new push session of ``run_id``: (the session, the object ids still to push,
    the message's objects by id)."""
    session = state.start_session(run_id)
    stored, missing = state.store_message_and_object_tree(message, get_object_tree(message),
                                                          session)
    assert stored and missing
    return session, missing, get_all_nested_objects(message)


def store_reply(state, run_id: int, node_id: int, instruction: Message,
                values: np.ndarray) -> Message:
    """What node ``node_id``'s SuperNode does with ``instruction`` (a message of run
    ``run_id`` in the link ``state``): take it, then store its reply (``values`` as its one
    array) and push all the reply's objects."""
    state.get_message_ins(node_id=node_id, limit=None)
    reply = Message(RecordDict({"update": ArrayRecord({"w": Array(values)})}),
                    reply_to=instruction)
    reply.metadata.__dict__["_message_id"] = reply.object_id
    session, missing, objects = stored_without_objects(state, run_id, reply)
    for object_id in missing:
        assert state.store_object(run_id, session, object_id, objects[object_id].deflate())
    return reply
