"""A deployment's ServerApp moves its message objects in batches, and every answer in a batch
is the one Flower gives the same request alone.

Flower's real SuperLink app (a fresh in-memory link state) is served behind the fast path
(flower_compat/runtime_fast_path.py) or as Flower serves it, over Starlette's test client.
The ServerApp side is Flower's own ``HttpGrid``, talking to that app through its real Runtime
API client.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    PullObjectRequest,
    PullObjectResponse,
    PushObjectRequest,
    PushObjectResponse,
)
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.superlink import main as superlink_main
from flwr.superlink.grid import http_grid
from starlette.testclient import TestClient

from dpcfl_flwr.flower_compat import object_batches
from dpcfl_flwr.flower_compat.object_batches import ObjectBatch
from dpcfl_flwr.flower_compat.runtime_fast_path import ObjectRequestsFastPath
from tests.runtime_api import HERE, Counted, post, store_reply


class Link:
    """A fresh SuperLink app, a run with a claimed ServerApp task, and one registered node."""

    def __init__(self, task_identity) -> None:
        self.flowers = Counted(superlink_main.create_app())
        self.state = self.flowers.state.runtime_state_factory.state()
        self.run_id = self.state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None,
                                            None, TaskType.SERVER_APP)
        task_id = self.state.get_run_info(run_ids=[self.run_id])[0].primary_task_id
        self.token = self.state.claim_task(task_id)
        task_identity(task_id, self.run_id, SUPERLINK_NODE_ID)
        (self.node,) = vce_api._register_nodes(1, self.flowers.state.linkstate_factory)

    def instruction(self, values: np.ndarray) -> Message:
        message = Message(RecordDict({"model": ArrayRecord({"w": Array(values)}),
                                      "config": ConfigRecord({"round": 1})}),
                          dst_node_id=self.node, message_type="train", ttl=3600)
        message.metadata.__dict__["_message_id"] = message.object_id
        return message

    def store_reply(self, instruction: Message, values: np.ndarray) -> Message:
        """What the node's SuperNode does: take the instruction, store its reply and push
        the reply's objects."""
        return store_reply(self.state, self.run_id, self.node, instruction, values)


def test_each_request_of_a_batch_gets_the_answer_it_gets_alone(task_identity):
    link = Link(task_identity)
    message = link.instruction(np.arange(6, dtype="float32"))
    session = link.state.start_session(link.run_id)
    stored, missing = link.state.store_message_and_object_tree(
        message, get_object_tree(message), session)
    assert stored and len(missing) >= 3
    objects = get_all_nested_objects(message)
    with TestClient(ObjectRequestsFastPath(link.flowers)) as client:
        pushes = [PushObjectRequest(node=HERE, run_id=link.run_id, session_id=session,
                                    object_id=i, object_content=objects[i].deflate())
                  for i in missing]
        pushed = post(client, "dpcfl-push-objects", ObjectBatch(
            items=[p.SerializeToString() for p in pushes]).SerializeToString(), link.token)
        assert pushed.status_code == 200, pushed.text
        answers = ObjectBatch.FromString(pushed.content).items
        assert [PushObjectResponse.FromString(a).stored for a in answers] == [True] * len(pushes)

        wanted = [*objects, "0" * 64]  # every object of the message, and one nobody stored
        pulls = [PullObjectRequest(node=HERE, run_id=link.run_id, object_id=i) for i in wanted]
        batch = ObjectBatch(items=[p.SerializeToString() for p in pulls]).SerializeToString()
        pulled = post(client, "dpcfl-pull-objects", batch, link.token)
        assert pulled.status_code == 200
        alone = [post(client, "pull-object", p.SerializeToString(), link.token).content
                 for p in pulls]
        assert list(ObjectBatch.FromString(pulled.content).items) == alone
        found = [PullObjectResponse.FromString(a) for a in alone]
        assert [r.object_content for r in found[:-1]] == [objects[i].deflate() for i in objects]
        assert not found[-1].object_found
        assert link.flowers.paths == []  # all answered by the fast path

        # a request Flower's handler refuses fails the batch with Flower's status for it
        foreign = PullObjectRequest(node=Node(node_id=link.node), run_id=link.run_id,
                                    object_id=message.object_id)
        refused = post(client, "dpcfl-pull-objects", ObjectBatch(items=[
            pulls[0].SerializeToString(), foreign.SerializeToString()]).SerializeToString(),
            link.token)
        assert refused.status_code == post(client, "pull-object", foreign.SerializeToString(),
                                            link.token).status_code == 412
        # no task behind the token, or a body that is no batch: Flower's app, which has no
        # such route
        assert post(client, "dpcfl-pull-objects", batch, "not-a-token").status_code == 404
        assert post(client, "dpcfl-pull-objects", b"\xff\xff", link.token).status_code == 404
        # nor does a batch larger than the ServerApp ever sends
        too_many = ObjectBatch(items=[pulls[0].SerializeToString()] * (
            object_batches.MAX_BATCH_ITEMS + 1)).SerializeToString()
        assert post(client, "dpcfl-pull-objects", too_many, link.token).status_code == 404
        assert link.flowers.paths == ["/v1/runtime/dpcfl-pull-objects"] * 3


def _grid(link: Link, fast_path: bool) -> tuple[http_grid.HttpGrid, TestClient, list[str]]:
    """Flower's ServerApp grid with its real Runtime API client, sending to the link's app
    behind the fast path or to Flower's app alone; and the paths it requests, in order."""
    app = ObjectRequestsFastPath(link.flowers) if fast_path else link.flowers
    grid = http_grid.HttpGrid(token=link.token, insecure=True)
    client = RuntimeHttpClient("http://testserver", interceptors=[
        RuntimeVersionHttpInterceptor(component_name="flwr-serverapp"),
        RuntimeTokenHttpInterceptor(token=link.token)])
    transport = TestClient(app)
    client._client = transport
    grid._client = client
    grid.set_run(Run.create_empty(link.run_id))
    paths: list[str] = []
    transport.event_hooks["request"].append(lambda request: paths.append(request.url.path))
    return grid, transport, paths


def _round_trip(link: Link, grid) -> tuple[Message, Message]:
    """Push an instruction through ``grid``, let the node reply, pull the reply."""
    values = np.linspace(0, 1, 50, dtype="float32")
    instruction = link.instruction(values)
    (message_id,) = grid.push_messages([instruction])
    assert message_id == instruction.object_id
    sent = link.store_reply(instruction, 2 * values)
    (got,) = grid.pull_messages([message_id])
    return sent, got


@pytest.fixture()
def batching_grids(monkeypatch):
    """Flower's HttpGrid module with the batches installed, restored afterwards."""
    for name in ("pull_objects", "push_objects", "make_pull_object_fn_protobuf",
                 "make_push_object_fn_protobuf"):  # install() may replace them: restore after
        monkeypatch.setattr(http_grid, name, getattr(http_grid, name))
    monkeypatch.setattr(http_grid.HttpGrid, "pull_messages", http_grid.HttpGrid.pull_messages)
    object_batches.install()  # (another test of this process may have installed it)
    assert http_grid.pull_objects.__module__ == object_batches.__name__
    assert not object_batches.install()  # once


@dataclass
class GridToLink:
    """A fresh link, Flower's ServerApp grid sending to it (``fast_path``: behind the fast
    path, else to Flower's app alone), its test transport and the paths it requested."""

    link: Link
    grid: http_grid.HttpGrid
    transport: TestClient
    paths: list[str]
    fast_path: bool


@pytest.fixture(params=[True, False], ids=["fast-path", "flowers-app"])
def grid_to_link(request, task_identity, batching_grids) -> GridToLink:
    link = Link(task_identity)
    return GridToLink(link, *_grid(link, request.param), fast_path=request.param)


def test_the_grid_moves_objects_in_batches_and_falls_back_to_flowers_requests(grid_to_link):
    link, grid, paths = grid_to_link.link, grid_to_link.grid, grid_to_link.paths
    with grid_to_link.transport:
        for _ in range(2):
            sent, got = _round_trip(link, grid)
            assert got.metadata.reply_to_message_id == sent.metadata.reply_to_message_id
            np.testing.assert_array_equal(got.content["update"]["w"].numpy(),
                                          sent.content["update"]["w"].numpy())
    routes = [p.rsplit("/", 1)[1] for p in paths]
    if grid_to_link.fast_path:  # one request each way for all of a message's objects
        assert routes == ["push-messages", "dpcfl-push-objects", "pull-messages",
                          "dpcfl-pull-objects", "confirm-message-received"] * 2
    else:  # Flower's SuperLink refuses the first batch; from then on, one per object
        assert [r for r in routes if r.startswith("dpcfl-")] == ["dpcfl-push-objects"]
        assert routes[:3] == ["push-messages", "dpcfl-push-objects", "push-object"]
        assert routes.count("pull-object") == 2 * len(get_all_nested_objects(sent))


def test_the_objects_of_all_replies_a_poll_brings_come_in_one_batch(grid_to_link):
    link, grid, paths = grid_to_link.link, grid_to_link.grid, grid_to_link.paths
    with grid_to_link.transport:
        values = [np.linspace(0, 1, 50, dtype="float32") + k for k in range(3)]
        instructions = [link.instruction(v) for v in values]
        ids = grid.push_messages(instructions)
        sent = {i.object_id: link.store_reply(i, 2 * v)
                for i, v in zip(instructions, values, strict=True)}
        del paths[:]
        got = list(grid.pull_messages(ids))
    assert sorted(m.metadata.reply_to_message_id for m in got) == sorted(ids)
    for reply in got:  # each reply whole, whichever way its objects came
        np.testing.assert_array_equal(
            reply.content["update"]["w"].numpy(),
            sent[reply.metadata.reply_to_message_id].content["update"]["w"].numpy())
    store = link.state.object_store
    assert not any(object_id in store for reply in sent.values()  # each reply confirmed:
                   for object_id in get_all_nested_objects(reply))  # the link dropped it
    routes = [p.rsplit("/", 1)[1] for p in paths]
    if grid_to_link.fast_path:  # and the three confirmations in one batch
        assert routes == ["pull-messages", "dpcfl-pull-objects", "dpcfl-confirm-messages"]
    else:  # Flower's SuperLink took no batch (the push's was refused): one per object
        assert "dpcfl-pull-objects" not in routes
        assert routes.count("confirm-message-received") == 3
        assert routes.count("pull-object") == sum(
            len(get_all_nested_objects(reply)) for reply in sent.values())
