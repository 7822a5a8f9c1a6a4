"""A SuperNode's message objects moved in one Fleet API request each way, not one per object.

Flower 1.39's SuperNode pulls every object of a message it receives with its own
``PullObject`` call and pushes every object of its reply with its own ``PushObject`` call: on
the quick example 3 and 3 a round per silo, each a gRPC call that the SuperNode signs and the
SuperLink verifies (node authentication: an ECDSA signature per call) and serves in Python, on
the cores the silos train on; with 21 silos, 126 of a round's ~190 Fleet calls.

Two methods are added to the SuperLink's Fleet service, ``DpcflPullObjects`` and
``DpcflPushObjects`` (:func:`serve`). Their request, a :data:`NodeBatch`, names the calling
node as every Fleet request does, so Flower's node authentication applies to it unchanged (the
call's signature, and the node id against the signing key); each of its items is a serialised
``PullObjectRequest`` (``PushObjectRequest``) that the SuperLink answers with Flower's own
Fleet servicer method, in order, and the answer holds their serialised responses. An item
naming another node is refused as Flower refuses such a request (UNAUTHENTICATED, "Invalid
node ID"); a batch of more than :data:`MAX_BATCH_ITEMS` items with INVALID_ARGUMENT. So a
batch can do nothing its items could not do one by one.

On the SuperNode's side (:func:`install`): the connection's stub pulls, at the first of a
received message's objects that Flower asks for, all of them in one batch, and answers
Flower's further calls for that message from what came (Flower's own call for anything else,
and for an object asked again, e.g. after Flower's back-off on one not yet available); and the
loop's push of a reply's objects goes out in batches. A SuperLink without the methods (stock
Flower, or ours with the tuning off) answers UNIMPLEMENTED: the connection then goes back to
one call per object for good. Any other error is the error of the call it replaced, which
Flower's retries and error handling treat as before.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .object_batches import MAX_BATCH_ITEMS, batches_of

logger = logging.getLogger(__name__)

SERVICE = "flwr.proto.Fleet"  # Flower's node authentication guards the methods of this service
PULL_METHOD, PUSH_METHOD = "DpcflPullObjects", "DpcflPushObjects"


def _node_batch_type() -> type:
    """``dpcfl.NodeBatch {dpcfl.BatchNode node = 1; repeated bytes items = 2;}`` with
    ``dpcfl.BatchNode {uint64 node_id = 1;}`` (the wire form of Flower's ``Node``)."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="dpcfl/node_batch.proto", package="dpcfl",
                                              syntax="proto3")
    node = file.message_type.add(name="BatchNode")
    node.field.add(name="node_id", number=1, type=field.TYPE_UINT64, label=field.LABEL_OPTIONAL)
    batch = file.message_type.add(name="NodeBatch")
    batch.field.add(name="node", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                    type_name=".dpcfl.BatchNode")
    batch.field.add(name="items", number=2, type=field.TYPE_BYTES, label=field.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dpcfl.NodeBatch"))


NodeBatch: Any = _node_batch_type()


# --- the SuperLink's side -------------------------------------------------------------------

def _answered_in_order(answer_one: Callable[[Any, Any], Any], request_type: Any
                       ) -> Callable[[Any, Any], Any]:
    """A batch method answering each item with ``answer_one`` (Flower's servicer method)."""
    import grpc

    def answer(batch: Any, context: Any) -> Any:
        if len(batch.items) > MAX_BATCH_ITEMS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a batch holds at most {MAX_BATCH_ITEMS} requests")
        responses = []
        for raw in batch.items:
            request = request_type.FromString(raw)
            if request.node.node_id != batch.node.node_id:  # the node the call was checked for
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "Invalid node ID")
            responses.append(answer_one(request, context).SerializeToString())
        return NodeBatch(node=batch.node, items=responses)

    return answer


def batch_methods(servicer: Any) -> Any:
    """The two batch methods of ``servicer`` (Flower's FleetServicer), as a gRPC handler."""
    import grpc
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PullObjectRequest,
        PushObjectRequest,
    )

    def method(answer_one: Callable[[Any, Any], Any], request_type: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            _answered_in_order(answer_one, request_type),
            request_deserializer=NodeBatch.FromString,
            response_serializer=NodeBatch.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE, {
        PULL_METHOD: method(servicer.PullObject, PullObjectRequest),
        PUSH_METHOD: method(servicer.PushObject, PushObjectRequest)})


def serve(superlink_cli: Any) -> bool:
    """Give the Fleet API that ``superlink_cli`` (Flower's ``flower_superlink`` module) starts
    the batch methods; False when it has them already."""
    add = superlink_cli.add_FleetServicer_to_server
    if getattr(add, "dpcfl_batches", False):
        return False

    def add_with_batches(servicer: Any, server: Any) -> None:
        add(servicer, server)
        server.add_generic_rpc_handlers((batch_methods(servicer),))

    add_with_batches.dpcfl_batches = True  # type: ignore[attr-defined]
    superlink_cli.add_FleetServicer_to_server = add_with_batches
    return True


# --- the SuperNode's side -------------------------------------------------------------------

def _object_ids(tree: Any) -> list[str]:
    """Every object id of an ``ObjectTree`` (protobuf), the root first."""
    ids, todo = [], [tree]
    while todo:
        node = todo.pop()
        ids.append(node.object_id)
        todo.extend(reversed(node.children))
    return ids


class ConnectionBatches:
    """One SuperNode connection's batch calls (plain gRPC calls: the stub method that uses
    them carries Flower's retries), with what it learnt from its pulls: the node, and the
    objects of the message received last, by run."""

    def __init__(self, channel: Any, pull_messages: Callable[[Any], Any],
                 pull_object: Callable[[Any], Any]) -> None:
        def call(method: str) -> Callable[[Any], Any]:
            return channel.unary_unary(  # type: ignore[no-any-return]
                f"/{SERVICE}/{method}", request_serializer=NodeBatch.SerializeToString,
                response_deserializer=NodeBatch.FromString)

        self.pull_batch, self.push_batch = call(PULL_METHOD), call(PUSH_METHOD)
        self._pull_messages, self._pull_object = pull_messages, pull_object
        self.usable = True
        self.node: Any = None
        self._lock = threading.Lock()
        self._expected: dict[int, list[str]] = {}  # run id -> objects of its last message
        self._pulled: dict[str, Any] = {}  # object id -> PullObjectResponse

    def send(self, call: Callable[[Any], Any], node: Any, items: list[bytes]
             ) -> list[bytes] | None:
        """The serialised responses to ``items``, in order; None when the SuperLink has no
        batch methods (then none is sent again)."""
        import grpc

        try:
            answer = call(NodeBatch(node={"node_id": node.node_id}, items=items))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                raise
            self.usable = False
            logger.info("the SuperLink takes no object batches: one call per object from now on")
            return None
        if len(answer.items) != len(items):
            raise RuntimeError(f"the SuperLink answered {len(answer.items)} of a batch of "
                               f"{len(items)} object requests")
        return list(answer.items)

    def pull_messages(self, request: Any) -> Any:
        """Flower's ``PullMessages``, noting the node and the objects of what came."""
        response = self._pull_messages(request)
        self.node = request.node
        if response.messages_list:
            with self._lock:
                self._pulled.clear()
                self._expected = {
                    message.metadata.run_id: _object_ids(tree) for message, tree in
                    zip(response.messages_list, response.message_object_trees, strict=False)}
        return response

    def pull_object(self, request: Any) -> Any:
        """Flower's ``PullObject``: from a batch of the message's objects, pulled at the
        first of them asked for; by Flower's own call otherwise."""
        with self._lock:
            wanted = self._expected.get(request.run_id, [])
            if self.usable and request.object_id in wanted:
                del self._expected[request.run_id]
                self._pull_batch(request, wanted)
            answer = self._pulled.pop(request.object_id, None)
        return answer if answer is not None else self._pull_object(request)

    def _pull_batch(self, request: Any, object_ids: list[str]) -> None:
        from flwr.proto.message_pb2 import (  # pylint: disable=E0611
            PullObjectRequest,
            PullObjectResponse,
        )

        for start in range(0, len(object_ids), MAX_BATCH_ITEMS):
            part = object_ids[start:start + MAX_BATCH_ITEMS]
            answers = self.send(self.pull_batch, request.node, [PullObjectRequest(
                node=request.node, run_id=request.run_id, object_id=object_id
            ).SerializeToString() for object_id in part])
            if answers is None:
                return
            self._pulled.update((object_id, PullObjectResponse.FromString(raw))
                                for object_id, raw in zip(part, answers, strict=True))


_current: list[weakref.ref[ConnectionBatches]] = []  # the connection made last in this process


def current_batches() -> ConnectionBatches | None:
    """The batches of the SuperNode connection made last in this process, if any."""
    return _current[-1]() if _current else None


def batching_stub(flowers_stub: type) -> type:
    """Flower's ``FleetStub`` whose ``PullMessages`` and ``PullObject`` go through
    :class:`ConnectionBatches` (Flower's retries then wrap these, as they wrap its own)."""

    class BatchingFleetStub(flowers_stub):  # type: ignore[misc, valid-type]
        def __init__(self, channel: Any) -> None:
            super().__init__(channel)
            flowers: Any = self  # its methods are set by Flower's generated __init__
            batches = ConnectionBatches(channel, flowers.PullMessages, flowers.PullObject)
            self.dpcfl_batches = batches  # not callable: Flower's retry wrapper leaves it
            flowers.PullMessages, flowers.PullObject = batches.pull_messages, batches.pull_object
            _current[:] = [weakref.ref(batches)]

    return BatchingFleetStub


def _pushed_in_batches(contents: list[tuple[str, bytes]], batches: ConnectionBatches,
                       run_id: int, session_id: str) -> int:
    """Push ``contents`` in batches; how many were pushed (fewer than all when the SuperLink
    turned out to take no batches)."""
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PushObjectRequest,
        PushObjectResponse,
    )
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    node, done = batches.node, 0
    for batch in batches_of(contents):
        answers = batches.send(batches.push_batch, node, [PushObjectRequest(
            node=node, run_id=run_id, session_id=session_id, object_id=object_id,
            object_content=content).SerializeToString() for object_id, content in batch])
        if answers is None:
            return done
        for (object_id, _), raw in zip(batch, answers, strict=True):
            if not PushObjectResponse.FromString(raw).stored:
                raise ObjectPushError(object_id, run_id, session_id)
        done += len(batch)
    return done


def install(connection: Any, loop: Any) -> bool:
    """Move the objects of a SuperNode made by Flower's ``connection`` module
    (``flwr.client.grpc_rere_client.connection``) and pushed by its ``loop`` module
    (``flwr.supernode.start_client_internal``) in batches; False when they do already."""
    if getattr(connection.FleetStub, "__name__", "") == "BatchingFleetStub":
        return False
    connection.FleetStub = batching_stub(connection.FleetStub)
    flowers_push = loop.push_object_contents_from_iterable

    def push_object_contents_from_iterable(object_contents: Iterable[tuple[str, bytes]],
                                           push_object_fn: Callable[[str, bytes], None],
                                           **options: Any) -> None:
        batches = current_batches()
        # Flower 1.39's loop pushes with partial(push_object, run_id, session_id)
        bound = (push_object_fn.args if isinstance(push_object_fn, functools.partial)
                 and not push_object_fn.keywords else ())
        if batches is None or not batches.usable or batches.node is None or len(bound) != 2:
            flowers_push(object_contents, push_object_fn, **options)
            return
        contents = list(object_contents)
        done = _pushed_in_batches(contents, batches, *bound)
        if done < len(contents):
            flowers_push(contents[done:], push_object_fn, **options)

    loop.push_object_contents_from_iterable = push_object_contents_from_iterable
    return True


__all__ = ["PULL_METHOD", "PUSH_METHOD", "SERVICE", "ConnectionBatches", "NodeBatch",
           "batch_methods", "batching_stub", "current_batches", "install", "serve"]
