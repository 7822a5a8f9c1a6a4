"""A SuperNode's message objects in one Fleet call each way: Flower's real Fleet gRPC server
(its node authentication included) and Flower's real SuperNode connection, over a real
channel on this machine; only the batching is ours.

Every object a batch brings is byte-equal to what Flower's one call per object brings; the
server sees one batch call where it saw a call per object, and the pull batch that
brings all of a message's objects confirms it, so Flower's confirmation makes no call; a batch
that finds an object not yet there confirms nothing; a reply goes with its objects in one call
when they are all in the SuperNode's store (Flower's way when one is not, or when the SuperLink
lacks that method alone); a SuperLink without the batch methods (Flower's answers UNKNOWN) is
served one call per object after its first refusal; an item naming another node is refused as
Flower refuses such a request.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
import threading

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.client.grpc_rere_client import connection
from flwr.common.constant import SUPERLINK_NODE_ID, Status
from flwr.proto.fleet_pb2 import PushMessagesRequest  # pylint: disable=E0611
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
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

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
    monkeypatch.setattr(loop, "_push_messages", loop._push_messages)  # noqa: SLF001
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


def _instruction(state, run_id: int, node_id: int, held_back: int = 0) -> Message:
    """A train message for the node, stored as the ServerApp's push stores one, but for its
    last ``held_back`` objects (``message.held_back``: (session, [(id, content)]))."""
    message = Message(RecordDict({
        "config": ConfigRecord({"round": 3, "model": np.arange(5000, dtype="<f4").tobytes()}),
        "extra": ArrayRecord({"w": Array(np.ones((30, 40)))})}),
        dst_node_id=node_id, message_type="train")
    message.metadata.__dict__["_run_id"] = run_id
    message.metadata.__dict__["_message_id"] = message.object_id
    session, missing, objects = stored_without_objects(state, run_id, message)
    stored = len(missing) - held_back
    for object_id in missing[:stored]:
        assert state.store_object(run_id, session, object_id, objects[object_id].deflate())
    message.held_back = (session, [(i, objects[i].deflate()) for i in missing[stored:]])
    return message


def _push_reply(received: Message, send, push_object, values: np.ndarray,
                late: int = 0) -> tuple[Message, dict[str, bytes]]:
    """A reply to ``received`` pushed by Flower's SuperNode loop from its own node state and
    object store, where the ClientApp's push leaves it, but for its last ``late`` objects
    (the loop waits for those); the reply and its objects by id."""
    reply = Message(RecordDict({"metrics": ConfigRecord({"update": values.tobytes()})}),
                    reply_to=received)
    reply.metadata.__dict__["_message_id"] = reply.object_id  # as the ClientApp's push
    objects = {i: o.deflate() for i, o in get_all_nested_objects(reply).items()}
    store = ObjectStoreFactory(FLWR_IN_MEMORY_DB_NAME).store()
    node_state = InMemoryNodeState(store)
    node_state.store_message(reply)
    store.preregister(received.metadata.run_id, get_object_tree(reply))
    ids = list(objects)
    for object_id in ids[:len(ids) - late]:
        store.put(object_id, objects[object_id])
    arrive = threading.Timer(0.2, lambda: [store.put(i, objects[i]) for i in ids[len(ids) - late:]])
    arrive.start()
    loop._push_messages(state=node_state, object_store=store, send=send,  # noqa: SLF001
                        push_object=push_object)
    arrive.join()
    return reply, objects


def _stored_reply(state, run_id: int, received: Message, reply: Message,
                  objects: dict[str, bytes]) -> None:
    """Assert that the SuperLink holds ``reply`` to ``received``, every object in."""
    [stored] = state.get_message_res({received.metadata.message_id}, run_id)
    assert stored.metadata.message_id == reply.metadata.message_id
    for object_id, content in objects.items():
        assert state.get_object(run_id, object_id) == content


@contextlib.contextmanager
def _connected(address: str, keys):
    """Flower's SuperNode connection. A failure in the body (an assertion's) is raised again
    once Flower has closed the connection: Flower's context manager would log it and go on,
    so the test would pass."""
    retries = loop._make_fleet_connection_retry_invoker(max_retries=0)  # noqa: SLF001
    failures = []
    with connection.grpc_request_response(address, insecure=True, retry_invoker=retries,
                                          authentication_keys=keys) as connected:
        try:
            yield connected
        except BaseException as failure:  # noqa: BLE001 - raised again below
            failures.append(failure)
    if failures:
        raise failures[0]


def test_a_messages_objects_come_in_one_call_that_confirms_it_and_its_reply_goes_in_one(fleet):
    state, run_id, node_id, keys, address, methods, batches = fleet
    with _connected(address, keys) as (node, receive, send, _, _, pull_object, push_object,
                                       confirm):
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
        # a stock SuperLink refuses the first batch (UNKNOWN: Flower's interceptor fails on
        # the missing method), and the SuperNode then pulls one object per call
        assert methods.called == ["PullMessages", "DpcflPullObjects", *(
            [] if batches else ["PullObject"] * len(ids))]
        confirm(run_id, sent.metadata.message_id)  # what Flower's loop does next
        assert methods.called[-1] == ("DpcflPullObjects" if batches
                                      else "ConfirmMessageReceived")
        # confirmed either way: the SuperLink has let the message's objects go
        assert all(state.get_object(run_id, i) is None for i in ids)

        del methods.called[:]
        reply, objects = _push_reply(received, send, push_object,
                                     np.full(4000, 0.5, dtype="<f4"))
        # one call with the reply and its objects; stock: Flower's message, then each object
        assert methods.called == (["DpcflPushMessage"] if batches else
                                  ["PushMessages", *["PushObject"] * len(objects)])
        _stored_reply(state, run_id, received, reply, objects)  # all in, as Flower's leave it


@pytest.mark.parametrize("fleet", ["batches"], indirect=True)
def test_a_reply_whose_objects_are_not_all_there_yet_goes_flowers_way(fleet):
    """Pushed before its last object is in the store: Flower's PushMessages, then the
    objects (the loop waits for the late one) in a batch."""
    state, run_id, node_id, keys, address, methods, _ = fleet
    with _connected(address, keys) as (_, receive, send, _, _, _, push_object, _):
        _instruction(state, run_id, node_id)
        received, _ = receive()
        del methods.called[:]
        reply, objects = _push_reply(received, send, push_object,
                                     np.full(4000, 0.25, dtype="<f4"), late=1)
        assert methods.called == ["PushMessages", "DpcflPushObjects"]
        _stored_reply(state, run_id, received, reply, objects)


@pytest.mark.parametrize("fleet", ["batches"], indirect=True)
def test_a_superlink_without_the_message_push_gets_the_message_then_its_objects(
        fleet, monkeypatch):
    """A SuperLink with the object batches but not the message push (an earlier version of
    this one): UNKNOWN on its first such call, after object batches were answered, and the
    reply then goes as Flower's PushMessages and an object batch, as do later ones."""
    state, run_id, node_id, keys, address, methods, _ = fleet
    monkeypatch.setattr(fleet_batches, "PUSH_MESSAGE_METHOD", "DpcflNoSuchMethod")
    with _connected(address, keys) as (_, receive, send, _, _, pull_object, push_object, _):
        batches = fleet_batches.current_batches()
        for value in (0.25, 0.75):
            sent = _instruction(state, run_id, node_id)
            received, _ = receive()
            loop.pull_objects([sent.metadata.message_id],
                              pull_object_fn=lambda i: pull_object(run_id, i))
            del methods.called[:]
            reply, objects = _push_reply(received, send, push_object,
                                         np.full(4000, value, dtype="<f4"))
            assert methods.called == (["DpcflNoSuchMethod"] if value == 0.25 else []) + [
                "PushMessages", "DpcflPushObjects"]
            _stored_reply(state, run_id, received, reply, objects)
        assert batches.usable and not batches.pushes_messages


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
        # a message push whose message names another node stores nothing
        foreign_push = PushMessagesRequest(node=Node(node_id=other))
        with pytest.raises(grpc.RpcError) as refused:
            calls.push_message_batch(NodeBatch(node={"node_id": node},
                                               message=foreign_push.SerializeToString()))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("fleet", ["batches"], indirect=True)
def test_a_batch_that_finds_an_object_not_yet_there_confirms_nothing(fleet):
    """The object the batch could not bring is asked again alone (Flower's back-off) and
    still there; Flower's confirmation then makes its own call."""
    state, run_id, node_id, keys, address, methods, _ = fleet
    with _connected(address, keys) as (_, receive, _, _, _, pull_object, _, confirm):
        sent = _instruction(state, run_id, node_id, held_back=1)
        session, [(late, content)] = sent.held_back
        receive()
        del methods.called[:]
        with pytest.raises(Exception, match="not yet available|not available"):
            pull_object(run_id, late)  # the message's first object asked: the whole batch
        assert methods.called == ["DpcflPullObjects"]
        assert state.store_object(run_id, session, late, content)
        assert pull_object(run_id, late) == content  # asked again: alone, and there
        confirm(run_id, sent.metadata.message_id)
        assert methods.called[1:] == ["PullObject", "ConfirmMessageReceived"]
