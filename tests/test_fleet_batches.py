"""A SuperNode's message objects in one Fleet call each way: Flower's real Fleet gRPC server
(its node authentication included) and Flower's real SuperNode connection, over a real
channel on this machine; only the batching is ours.

Every object a batch brings is byte-equal to what Flower's one call per object brings; the
server sees one batch call where it saw a call per object; a SuperLink without the batch
methods is served one call per object, as before; an item naming another node is refused as
Flower refuses such a request.
"""

from __future__ import annotations

import functools
import importlib
import socket

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.client.grpc_rere_client import connection
from flwr.common.constant import SUPERLINK_NODE_ID, Status
from flwr.proto.message_pb2 import PullObjectRequest  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.server.superlink.fleet.grpc_rere.node_auth_server_interceptor import (
    NodeAuthServerInterceptor,
)
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
from flwr.superlink.federation import NoOpFederationManager
from flwr.supernode import start_client_internal as loop

from dpcfl_flwr.flower_compat import fleet_batches
from dpcfl_flwr.flower_compat.fleet_batches import NodeBatch
from tests.runtime_api import stored_without_objects

flower_superlink = importlib.import_module("flwr.superlink.cli.flower_superlink")


class Methods(grpc.ServerInterceptor):
    """The Fleet methods called, in order, but the node's heartbeats (its own timer sends
    them, the first right after activation, whenever its thread gets to it)."""

    def __init__(self) -> None:
        self.called: list[str] = []

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method != "SendNodeHeartbeat":
            self.called.append(method)
        return continuation(handler_call_details)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(params=["batches", "stock"])
def fleet(request, monkeypatch, task_identity):
    """(state, run id, node id, keys, address, methods called): Flower's Fleet API on a free
    port, with the batch methods or (stock) without; a registered node with its keys; and
    Flower's SuperNode connection and loop modules batching (restored afterwards)."""
    monkeypatch.setattr(connection, "FleetStub", connection.FleetStub)
    monkeypatch.setattr(loop, "push_object_contents_from_iterable",
                        loop.push_object_contents_from_iterable)
    monkeypatch.setattr(flower_superlink, "add_FleetServicer_to_server",
                        flower_superlink.add_FleetServicer_to_server)
    assert fleet_batches.install(connection, loop)
    assert not fleet_batches.install(connection, loop)  # once
    if request.param == "batches":
        assert fleet_batches.serve(flower_superlink)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory(FLWR_IN_MEMORY_DB_NAME))
    state = factory.state()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None,
                              TaskType.SERVER_APP)
    task_id = state.get_run_info(run_ids=[run_id])[0].primary_task_id
    assert state.claim_task(task_id) and state.activate_task(task_id)  # the run is running
    assert state.get_run_status({run_id})[run_id].status == Status.RUNNING
    task_identity(task_id, run_id, SUPERLINK_NODE_ID)
    keys = generate_key_pairs()
    node_id = state.create_node("owner", "silo", public_key_to_bytes(keys[1]), 30.0)
    methods = Methods()
    address = f"127.0.0.1:{_free_port()}"
    server = flower_superlink._run_fleet_api_grpc_rere(  # pylint: disable=protected-access
        address=address, state_factory=factory,
        objectstore_factory=factory.objectstore_factory, enable_supernode_auth=True,
        certificates=None, interceptors=[NodeAuthServerInterceptor(factory), methods])
    yield state, run_id, node_id, keys, address, methods, request.param == "batches"
    server.stop(grace=None)


def _instruction(state, run_id: int, node_id: int) -> Message:
    """A train message for the node, stored as the ServerApp's push stores one."""
    message = Message(RecordDict({
        "config": ConfigRecord({"round": 3, "model": np.arange(5000, dtype="<f4").tobytes()}),
        "extra": ArrayRecord({"w": Array(np.ones((30, 40)))})}),
        dst_node_id=node_id, message_type="train")
    message.metadata.__dict__["_run_id"] = run_id
    message.metadata.__dict__["_message_id"] = message.object_id
    session, missing, objects = stored_without_objects(state, run_id, message)
    for object_id in missing:
        assert state.store_object(run_id, session, object_id, objects[object_id].deflate())
    return message


def _connected(address: str, keys):
    retries = loop._make_fleet_connection_retry_invoker(max_retries=0)  # noqa: SLF001
    return connection.grpc_request_response(address, insecure=True, retry_invoker=retries,
                                            authentication_keys=keys)


def test_a_messages_objects_come_and_its_replys_go_in_one_call_each(fleet):
    state, run_id, node_id, keys, address, methods, batches = fleet
    with _connected(address, keys) as (node, receive, send, _, _, pull_object, push_object, _):
        assert node == node_id  # activated: a message may be stored for it
        sent = _instruction(state, run_id, node_id)
        sent_objects = {i: o.deflate() for i, o in get_all_nested_objects(sent).items()}
        del methods.called[:]
        received, tree = receive()
        assert received.metadata.message_id == sent.metadata.message_id
        ids = [i for i in sent_objects if i != sent.metadata.message_id] + [
            sent.metadata.message_id]
        pulled = loop.pull_objects(ids, pull_object_fn=lambda i: pull_object(run_id, i))
        assert pulled == {i: sent_objects[i] for i in ids}  # byte-equal, whichever way
        assert methods.called == ["PullMessages", *(
            ["DpcflPullObjects"] if batches else ["PullObject"] * len(ids))]
        # an object asked again (Flower's back-off after "not yet available") goes alone
        assert pull_object(run_id, ids[0]) == sent_objects[ids[0]]
        assert methods.called[-1] == "PullObject"

        reply = Message(RecordDict({"metrics": ConfigRecord({
            "update": np.full(4000, 0.5, dtype="<f4").tobytes()})}), reply_to=received)
        del methods.called[:]
        to_push, session = send(reply, get_object_tree(reply), 0.1)
        reply_objects = {i: o.deflate() for i, o in get_all_nested_objects(reply).items()}
        loop.push_object_contents_from_iterable(
            ((i, reply_objects[i]) for i in to_push),
            push_object_fn=functools.partial(push_object, run_id, session))
        assert methods.called == ["PushMessages", *(
            ["DpcflPushObjects"] if batches else ["PushObject"] * len(to_push))]
        for object_id, content in reply_objects.items():  # all in, as Flower's leave them
            assert state.get_object(run_id, object_id) == content


@pytest.mark.parametrize("fleet", ["batches"], indirect=True)  # a stock one has none
def test_a_batch_item_naming_another_node_is_refused(fleet):
    state, run_id, node_id, keys, address, methods, batches = fleet
    other = state.create_node("owner", "other", public_key_to_bytes(generate_key_pairs()[1]),
                              30.0)
    with _connected(address, keys) as (node, receive, *_):
        sent = _instruction(state, run_id, node_id)
        receive()
        calls = fleet_batches.current_batches()
        own = PullObjectRequest(node=Node(node_id=node), run_id=run_id,
                                object_id=sent.metadata.message_id)
        foreign = PullObjectRequest(node=Node(node_id=other), run_id=run_id,
                                    object_id=sent.metadata.message_id)
        [answer] = calls.send(calls.pull_batch, Node(node_id=node), [own.SerializeToString()])
        assert answer  # its own node's item is answered
        with pytest.raises(grpc.RpcError) as refused:
            calls.pull_batch(NodeBatch(node={"node_id": node}, items=[
                own.SerializeToString(), foreign.SerializeToString()]))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as too_many:
            calls.pull_batch(NodeBatch(node={"node_id": node},
                                       items=[own.SerializeToString()] * 257))
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
