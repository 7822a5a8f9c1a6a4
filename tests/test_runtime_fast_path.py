"""The SuperLink answers the ServerApp's object requests and reply polls without FastAPI's
routing, and every answer is the one Flower's own app gives: Flower's real SuperLink app is
built twice (two fresh link states, in memory or SQLite), once as Flower serves it and once
behind the fast path, and both get the same requests over Starlette's test client.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    ConfirmMessageReceivedRequest,
    PullObjectRequest,
    PullObjectResponse,
    PushObjectRequest,
)
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    PullAppMessagesRequest,
    PullAppMessagesResponse,
)
from flwr.server.superlink.fleet.vce import vce_api
from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
from flwr.superlink import main as superlink_main
from starlette.testclient import TestClient

from dpcfl_flwr import flower_compat
from dpcfl_flwr.flower_compat import runtime_fast_path
from dpcfl_flwr.flower_compat.runtime_fast_path import ObjectRequestsFastPath
from tests.runtime_api import HERE, PROTOBUF, Counted, post, store_reply, stored_without_objects

POLLS = 4  # the reply polls among the requests


def exchange(wrap, task_identity) -> tuple[list[tuple], list[str]]:
    """A ServerApp's object traffic and the ways it can go wrong, against a fresh SuperLink
    app (its state as FLWR_DATABASE says) wrapped by ``wrap``: (status, headers, body) per
    request, and the paths that reached Flower's app."""
    flowers = Counted(superlink_main.create_app())
    state = flowers.state.runtime_state_factory.state()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None,
                              TaskType.SERVER_APP)
    task_id = state.get_run_info(run_ids=[run_id])[0].primary_task_id
    token = state.claim_task(task_id)
    assert token
    task_identity(task_id, run_id, SUPERLINK_NODE_ID)
    (node,) = vce_api._register_nodes(1, flowers.state.linkstate_factory)
    message = Message(RecordDict({"model": ArrayRecord({"w": Array(
        np.arange(6, dtype="float32"))})}), dst_node_id=node, message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id
    session, missing, objects = stored_without_objects(state, run_id, message)
    answers = []
    with TestClient(wrap(flowers)) as client:
        def record(response) -> None:
            body = response.content
            if (response.status_code == 200 and response.request.url.path.endswith("pull-object")
                    and response.headers["content-type"] == PROTOBUF):
                # the message's bytes name this state's run: compare them with its own object
                pulled = PullObjectResponse.FromString(body)
                if pulled.object_content == objects[message.object_id].deflate():
                    pulled.object_content = b"<the message>"
                body = pulled.SerializeToString()
            if (response.status_code == 200 and response.request.url.path.endswith("pull-messages")
                    and response.headers["content-type"] == PROTOBUF):
                # the replies' ids name this state's run: keep what they are and answer
                polled = PullAppMessagesResponse.FromString(body)
                body = repr([(m.metadata.message_type, m.metadata.src_node_id == node,
                              m.metadata.reply_to_message_id == message.object_id)
                             for m in polled.messages_list]).encode()
            headers = sorted((k, v) for k, v in response.headers.items()
                             if k != "content-length")  # the message's length names its run
            answers.append((response.status_code, headers, body))

        for object_id in missing:  # the push of a message's objects
            record(post(client, "push-object", PushObjectRequest(
                node=HERE, run_id=run_id, session_id=session, object_id=object_id,
                object_content=objects[object_id].deflate()).SerializeToString(), token))
        # the ServerApp's reply poll: nothing yet; the node's reply; Flower's app answers the
        # last two (no token, a body that does not parse)
        poll = PullAppMessagesRequest(message_ids=[message.object_id]).SerializeToString()
        record(post(client, "pull-messages", poll, token))
        store_reply(state, run_id, node, message, np.ones(3, dtype="float32"))
        record(post(client, "pull-messages", poll, token))
        record(post(client, "pull-messages", poll, None))
        record(post(client, "pull-messages", b"\xff\xff\xff", token))
        pull = PullObjectRequest(node=HERE, run_id=run_id, object_id=message.object_id)
        record(post(client, "pull-object", pull.SerializeToString(), token))
        record(post(client, "pull-object", PullObjectRequest(
            node=HERE, run_id=run_id, object_id="0" * 64).SerializeToString(), token))
        # the handler refuses: Flower's error translation answers
        record(post(client, "pull-object", PullObjectRequest(
            node=Node(node_id=node), run_id=run_id,
            object_id=message.object_id).SerializeToString(), token))
        # Flower's app answers these before any handler runs
        record(post(client, "pull-object", pull.SerializeToString(), None))
        record(post(client, "pull-object", pull.SerializeToString(), "not-a-token"))
        record(post(client, "pull-object", pull.SerializeToString(), token,
                     **{"content-type": "application/json"}))
        record(post(client, "pull-object", b"\xff\xff\xff", token))
        record(post(client, "pull-object", pull.SerializeToString(), token,
                     **{"flwr-package-version": "1.38.0"}))  # another minor version
        record(post(client, "confirm-message-received", ConfirmMessageReceivedRequest(
            node=HERE, run_id=run_id,
            message_object_id=message.object_id).SerializeToString(), token))
        record(post(client, "pull-object", pull.SerializeToString(), token))  # gone
        record(client.get("/health"))
    return answers, flowers.paths


@pytest.mark.parametrize("database", ["in-memory", "sqlite"])
def test_object_requests_skip_flowers_routing_and_get_flowers_answers(
        database, task_identity, monkeypatch, tmp_path):
    # `dpcfl server` keeps its state in SQLite unless --in-memory
    def fresh_state(name: str) -> None:
        if database == "sqlite":
            monkeypatch.setenv("FLWR_DATABASE", str(tmp_path / f"{name}.db"))

    fresh_state("flower")
    flowers, reached_flower = exchange(lambda app: app, task_identity)
    fresh_state("ours")
    ours, reached_ours = exchange(ObjectRequestsFastPath, task_identity)
    assert ours == flowers
    pulled = PullObjectResponse.FromString(flowers[-11][2])
    assert pulled.object_found and pulled.object_content == b"<the message>"
    statuses = [status for status, _, _ in flowers]
    pushes = len(statuses) - 11 - POLLS
    assert statuses == [200] * pushes + [200, 200, 401, 400] + [
        200, 200, 412, 401, 401, 415, 400, 412, 200, 200, 200], statuses
    polls = [body for _, _, body in flowers[pushes:pushes + 2]]
    assert polls == [b"[]", repr([("train", True, True)]).encode()], polls
    assert len(reached_flower) == len(statuses)
    # only the refused requests and the health check reached Flower's app
    assert reached_ours == (["/v1/runtime/pull-messages"] * 2 + ["/v1/runtime/pull-object"] * 5
                            + ["/health"])


def test_install_only_on_the_known_flower_version(monkeypatch):
    monkeypatch.setattr(flower_compat.gate, "TUNING", False)
    assert not runtime_fast_path.install()
    monkeypatch.setattr(flower_compat.gate, "TUNING", True)
    assert runtime_fast_path.install()
    assert isinstance(superlink_main.create_app(), ObjectRequestsFastPath)


def test_an_event_log_plugin_keeps_flowers_app(monkeypatch):
    monkeypatch.setenv("FLWR_ENABLE_EVENT_LOG", "1")
    monkeypatch.setattr(superlink_main, "load_control_event_log_plugin", lambda: object())
    assert runtime_fast_path.install()
    assert not isinstance(superlink_main.create_app(), ObjectRequestsFastPath)


@pytest.fixture(autouse=True)
def _flowers_create_app(monkeypatch):
    """install() replaces the module's function: restore it after each test."""
    monkeypatch.setattr(superlink_main, "create_app", superlink_main.create_app)
