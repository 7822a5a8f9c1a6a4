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
Flower, or ours with the tuning off) answers UNIMPLEMENTED, or, as Flower 1.39's does, UNKNOWN
(its error-translation interceptor fails on the missing method): the connection then goes back
to one call per object for good. UNKNOWN counts so only until a batch call was answered. Any
other error is the error of the call it replaced, which Flower's retries and error handling
treat as before.

A pull batch that brings all of a message's objects also carries the message's
``ConfirmMessageReceivedRequest`` (the batch's ``confirm``): the SuperLink answers it with
Flower's servicer method right after the pulls, only if every pull found its object
available, and says so (``confirmed``); Flower's confirmation of that message then costs no
call. Flower's confirmation only lets the SuperLink drop the objects a SuperNode has pulled,
and Flower's SuperNode pulls each object once unless it was not yet available, so nothing it
would ask again is dropped. A SuperLink that does not know the field answers without
``confirmed``, and the SuperNode confirms with its own call as before. One call less per
message, and a round trip less before each silo starts its round.

A reply goes with its objects in one call, ``DpcflPushMessage``, when they are all in the
SuperNode's object store as Flower's loop pushes it (they are once the ClientApp is done): its
request carries the serialised ``PushMessagesRequest`` (the batch's ``message``) and, as items,
the objects' ``PushObjectRequest``s without a session. The SuperLink answers the message with
Flower's ``PushMessages``, then each item Flower asked for with Flower's ``PushObject`` in the
push session Flower opened, and returns Flower's ``PushMessagesResponse`` less the objects now
stored: Flower's loop then pushes none, or those left (an object Flower did not store, the
objects past one batch) as before. The message and every item must name the calling node. A
SuperLink without the method answers as above, and the SuperNode pushes its replies Flower's
way, PushMessages then the objects in batches. Two calls become one: a silo-round takes three
Fleet calls (PullMessages, DpcflPullObjects, DpcflPushMessage) where Flower makes three and
one per object of the message and of its reply (9 on the quick example).
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
PUSH_MESSAGE_METHOD = "DpcflPushMessage"


def _node_batch_type() -> type:
    """``dpcfl.NodeBatch {dpcfl.BatchNode node = 1; repeated bytes items = 2; bytes confirm =
    3; bool confirmed = 4; bytes message = 5;}`` with ``dpcfl.BatchNode {uint64 node_id =
    1;}`` (the wire form of Flower's ``Node``); ``confirm`` and ``confirmed`` are the pull
    batch's, ``message`` the message push's (module doc)."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="dpcfl/node_batch.proto", package="dpcfl",
                                              syntax="proto3")
    node = file.message_type.add(name="BatchNode")
    node.field.add(name="node_id", number=1, type=field.TYPE_UINT64, label=field.LABEL_OPTIONAL)
    batch = file.message_type.add(name="NodeBatch")
    batch.field.add(name="node", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                    type_name=".dpcfl.BatchNode")
    batch.field.add(name="items", number=2, type=field.TYPE_BYTES, label=field.LABEL_REPEATED)
    batch.field.add(name="confirm", number=3, type=field.TYPE_BYTES, label=field.LABEL_OPTIONAL)
    batch.field.add(name="confirmed", number=4, type=field.TYPE_BOOL,
                    label=field.LABEL_OPTIONAL)
    batch.field.add(name="message", number=5, type=field.TYPE_BYTES, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dpcfl.NodeBatch"))


NodeBatch: Any = _node_batch_type()


# --- the SuperLink's side -------------------------------------------------------------------

def _answered_in_order(answer_one: Callable[[Any, Any], Any], request_type: Any,
                       confirm: Callable[[Any, Any, list[Any]], bool] | None = None
                       ) -> Callable[[Any, Any], Any]:
    """A batch method answering each item with ``answer_one`` (Flower's servicer method), then
    the batch's ``confirm`` with ``confirm`` (pull batches only: :func:`_confirmed`)."""
    def answer(batch: Any, context: Any) -> Any:
        responses = [answer_one(request, context)
                     for request in _items(batch, request_type, context)]
        confirmed = confirm is not None and bool(batch.confirm) and confirm(
            batch, context, responses)
        return NodeBatch(node=batch.node, items=[r.SerializeToString() for r in responses],
                         confirmed=confirmed)

    return answer


def _items(batch: Any, request_type: Any, context: Any) -> list[Any]:
    """The batch's items parsed as ``request_type``, the call refused (as Flower refuses a
    request naming another node) unless each names the node the call was checked for, and
    with INVALID_ARGUMENT past :data:`MAX_BATCH_ITEMS` items."""
    import grpc

    if len(batch.items) > MAX_BATCH_ITEMS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"a batch holds at most {MAX_BATCH_ITEMS} requests")
    items = [request_type.FromString(raw) for raw in batch.items]
    _check_node(batch, items, context)
    return items


def _check_node(batch: Any, requests: list[Any], context: Any) -> None:
    """Refuse the call unless every request names the batch's node, the one Flower's node
    authentication checked the call for."""
    import grpc

    if any(request.node.node_id != batch.node.node_id for request in requests):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "Invalid node ID")


def _message_pushed(push_message: Callable[[Any, Any], Any],
                    push_object: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """The message push (module doc): ``push_message`` (Flower's ``PushMessages``) on the
    batch's message, then ``push_object`` (Flower's ``PushObject``) on each item Flower asked
    for, in the session it opened; the answer's ``message`` is Flower's response less the
    objects stored. An object push that fails stays asked for: the SuperNode pushes it with
    Flower's own call and gets Flower's answer there."""
    from flwr.proto.fleet_pb2 import PushMessagesRequest  # pylint: disable=E0611
    from flwr.proto.message_pb2 import PushObjectRequest  # pylint: disable=E0611

    def answer(batch: Any, context: Any) -> Any:
        objects = _items(batch, PushObjectRequest, context)
        request = PushMessagesRequest.FromString(batch.message)
        _check_node(batch, [request], context)
        response = push_message(request, context)
        wanted = set(response.objects_to_push)
        for item in objects:
            if item.object_id not in wanted:
                continue
            item.session_id = response.session_id
            try:
                stored = push_object(item, context).stored
            except Exception:  # noqa: BLE001 - the SuperNode's own call gets Flower's error
                logger.debug("an object of a message push failed", exc_info=True)
                continue
            if stored:
                wanted.discard(item.object_id)
        left = [object_id for object_id in response.objects_to_push if object_id in wanted]
        del response.objects_to_push[:]
        response.objects_to_push.extend(left)
        return NodeBatch(node=batch.node, message=response.SerializeToString())

    return answer


def _confirmed(confirm_one: Callable[[Any, Any], Any]) -> Callable[[Any, Any, list[Any]], bool]:
    """A pull batch's confirmation: ``confirm_one`` (Flower's servicer method) on the batch's
    ``ConfirmMessageReceivedRequest`` once every pull found its object available; whether it
    was confirmed. A failed confirmation is Flower's to report: the SuperNode, told nothing
    was confirmed, confirms with its own call and gets Flower's answer there."""
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=E0611

    def confirm(batch: Any, context: Any, pulled: list[Any]) -> bool:
        request = ConfirmMessageReceivedRequest.FromString(batch.confirm)
        _check_node(batch, [request], context)
        if not all(p.object_found and p.object_available for p in pulled):
            return False
        try:
            confirm_one(request, context)
        except Exception:  # noqa: BLE001 - the SuperNode's own call gets Flower's error
            logger.debug("a pull batch's confirmation failed", exc_info=True)
            return False
        return True

    return confirm


def batch_methods(servicer: Any) -> Any:
    """The three batch methods of ``servicer`` (Flower's FleetServicer), as a gRPC handler."""
    import grpc
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PullObjectRequest,
        PushObjectRequest,
    )

    def method(answered: Callable[[Any, Any], Any]) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            answered, request_deserializer=NodeBatch.FromString,
            response_serializer=NodeBatch.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE, {
        PULL_METHOD: method(_answered_in_order(servicer.PullObject, PullObjectRequest,
                                               _confirmed(servicer.ConfirmMessageReceived))),
        PUSH_METHOD: method(_answered_in_order(servicer.PushObject, PushObjectRequest)),
        PUSH_MESSAGE_METHOD: method(_message_pushed(servicer.PushMessages,
                                                    servicer.PushObject))})


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
    objects and id of the message received last, by run; and the SuperNode's object store,
    where a reply's objects are when it is pushed (:func:`install`)."""

    def __init__(self, channel: Any, pull_messages: Callable[[Any], Any],
                 pull_object: Callable[[Any], Any],
                 confirm_message_received: Callable[[Any], Any],
                 push_messages: Callable[[Any], Any]) -> None:
        def call(method: str) -> Callable[[Any], Any]:
            return channel.unary_unary(  # type: ignore[no-any-return]
                f"/{SERVICE}/{method}", request_serializer=NodeBatch.SerializeToString,
                response_deserializer=NodeBatch.FromString)

        self.pull_batch, self.push_batch = call(PULL_METHOD), call(PUSH_METHOD)
        self.push_message_batch = call(PUSH_MESSAGE_METHOD)
        self._pull_messages, self._pull_object = pull_messages, pull_object
        self._confirm, self._push_messages = confirm_message_received, push_messages
        self.usable = True  # whether the SuperLink takes object batches
        self.pushes_messages = True  # whether it takes a reply with its objects
        self._answered: set[Any] = set()  # batch calls answered once: UNKNOWN then is an error
        self.node: Any = None
        self.store: Any = None  # the SuperNode's ObjectStore, once its loop pushes a reply
        self._lock = threading.Lock()
        self._expected: dict[int, list[str]] = {}  # run id -> objects of its last message
        self._pulled: dict[str, Any] = {}  # object id -> PullObjectResponse
        self._messages: dict[int, str] = {}  # run id -> id of its message received last
        self._confirmed: set[tuple[int, str]] = set()  # (run id, message id) a batch confirmed

    def send(self, call: Callable[[Any], Any], node: Any, items: list[bytes]
             ) -> list[bytes] | None:
        """The serialised responses to ``items``, in order; None when the SuperLink has no
        batch methods (then none is sent again)."""
        answer = self._items_answered(call, NodeBatch(node={"node_id": node.node_id},
                                                      items=items))
        return None if answer is None else list(answer.items)

    def _items_answered(self, call: Callable[[Any], Any], batch: Any) -> Any | None:
        """The SuperLink's answer to the object batch ``batch``, one response per item; None
        when it has no object batches (then no object batch goes again)."""
        answer = self._answer(call, batch)
        if answer is None:
            self.usable = False
            logger.info("the SuperLink takes no object batches: one call per object from now on")
            return None
        if len(answer.items) != len(batch.items):
            raise RuntimeError(f"the SuperLink answered {len(answer.items)} of a batch of "
                               f"{len(batch.items)} object requests")
        return answer

    def _answer(self, call: Callable[[Any], Any], batch: Any) -> Any | None:
        """The SuperLink's answer to ``batch``; None when it lacks the method ``call`` calls."""
        import grpc

        try:
            answer = call(batch)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            # Flower 1.39's SuperLink answers a method it lacks with UNKNOWN, not
            # UNIMPLEMENTED: its error-translation interceptor fails on the missing handler
            if not (code == grpc.StatusCode.UNIMPLEMENTED or (
                    code == grpc.StatusCode.UNKNOWN and call not in self._answered)):
                raise
            return None
        self._answered.add(call)
        return answer

    def push_messages(self, request: Any) -> Any:
        """Flower's ``PushMessages``, in one call with the reply's objects when they are all
        in the object store (module doc); Flower's call otherwise."""
        from flwr.proto.fleet_pb2 import PushMessagesResponse  # pylint: disable=E0611

        contents = self._reply_contents(request) if self.usable and self.pushes_messages else []
        if contents:
            answer = self._answer(self.push_message_batch,
                                  self._message_batch(request, contents))
            if answer is not None:
                return PushMessagesResponse.FromString(answer.message)
            self.pushes_messages = False
            logger.info("the SuperLink takes no reply with its objects: a reply's objects "
                        "go after it from now on")
        return self._push_messages(request)

    def _reply_contents(self, request: Any) -> list[tuple[str, bytes]]:
        """The first batch of the pushed reply's objects, from the object store; none unless
        there is one reply and every one of its objects is there (Flower's loop then waits
        for the missing ones)."""
        if self.store is None or len(request.message_object_trees) != 1:
            return []
        contents = []
        for object_id in dict.fromkeys(_object_ids(request.message_object_trees[0])):
            content = self.store.get(object_id)
            if not content:  # None: not in the store; b"": not yet there
                return []
            contents.append((object_id, content))
        return next(batches_of(contents), [])

    @staticmethod
    def _message_batch(request: Any, contents: list[tuple[str, bytes]]) -> Any:
        from flwr.proto.message_pb2 import PushObjectRequest  # pylint: disable=E0611

        run_id = request.messages_list[0].metadata.run_id
        return NodeBatch(node={"node_id": request.node.node_id},
                         message=request.SerializeToString(), items=[
                             PushObjectRequest(node=request.node, run_id=run_id,
                                               object_id=object_id, object_content=content
                                               ).SerializeToString()
                             for object_id, content in contents])

    def pull_messages(self, request: Any) -> Any:
        """Flower's ``PullMessages``, noting the node and the objects of what came."""
        response = self._pull_messages(request)
        self.node = request.node
        if response.messages_list:
            with self._lock:
                self._pulled.clear()
                self._confirmed.clear()
                self._messages = {message.metadata.run_id: message.metadata.message_id
                                  for message in response.messages_list}
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

    def confirm_message_received(self, request: Any) -> Any:
        """Flower's ``ConfirmMessageReceived``: no call for a message whose pull batch the
        SuperLink confirmed already (module doc)."""
        from flwr.proto.message_pb2 import (  # pylint: disable=E0611
            ConfirmMessageReceivedResponse,
        )

        key = (request.run_id, request.message_object_id)
        with self._lock:
            if key in self._confirmed:
                self._confirmed.discard(key)
                return ConfirmMessageReceivedResponse()
        return self._confirm(request)

    def _pull_batch(self, request: Any, object_ids: list[str]) -> None:
        from flwr.proto.message_pb2 import (  # pylint: disable=E0611
            ConfirmMessageReceivedRequest,
            PullObjectRequest,
            PullObjectResponse,
        )

        message_id = self._messages.pop(request.run_id, None)
        confirm = b"" if message_id is None or len(object_ids) > MAX_BATCH_ITEMS else (
            ConfirmMessageReceivedRequest(node=request.node, run_id=request.run_id,
                                          message_object_id=message_id).SerializeToString())
        for start in range(0, len(object_ids), MAX_BATCH_ITEMS):
            part = object_ids[start:start + MAX_BATCH_ITEMS]
            answer = self._items_answered(self.pull_batch, NodeBatch(
                node={"node_id": request.node.node_id}, confirm=confirm, items=[
                    PullObjectRequest(node=request.node, run_id=request.run_id,
                                      object_id=object_id).SerializeToString()
                    for object_id in part]))
            if answer is None:
                return
            if answer.confirmed:
                self._confirmed.add((request.run_id, str(message_id)))
            self._pulled.update((object_id, PullObjectResponse.FromString(raw))
                                for object_id, raw in zip(part, answer.items, strict=True))


_current: list[weakref.ref[ConnectionBatches]] = []  # the connection made last in this process


def current_batches() -> ConnectionBatches | None:
    """The batches of the SuperNode connection made last in this process, if any."""
    return _current[-1]() if _current else None


def batching_stub(flowers_stub: type) -> type:
    """Flower's ``FleetStub`` whose ``PullMessages``, ``PullObject``,
    ``ConfirmMessageReceived`` and ``PushMessages`` go through :class:`ConnectionBatches`
    (Flower's retries then wrap these, as they wrap its own)."""

    class BatchingFleetStub(flowers_stub):  # type: ignore[misc, valid-type]
        def __init__(self, channel: Any) -> None:
            super().__init__(channel)
            flowers: Any = self  # its methods are set by Flower's generated __init__
            batches = ConnectionBatches(channel, flowers.PullMessages, flowers.PullObject,
                                        flowers.ConfirmMessageReceived, flowers.PushMessages)
            self.dpcfl_batches = batches  # not callable: Flower's retry wrapper leaves it
            flowers.PullMessages, flowers.PullObject = batches.pull_messages, batches.pull_object
            flowers.ConfirmMessageReceived = batches.confirm_message_received
            flowers.PushMessages = batches.push_messages
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

    flowers_push_messages = loop._push_messages  # pylint: disable=protected-access

    def _push_messages(*args: Any, **kwargs: Any) -> None:
        """Flower's reply push, the connection told the object store it reads from (Flower
        1.39 passes it as ``object_store``)."""
        batches = current_batches()
        if batches is not None:
            batches.store = kwargs.get("object_store", args[1] if len(args) > 1 else None)
        flowers_push_messages(*args, **kwargs)

    loop.push_object_contents_from_iterable = push_object_contents_from_iterable
    loop._push_messages = _push_messages  # pylint: disable=protected-access
    return True


__all__ = ["PULL_METHOD", "PUSH_MESSAGE_METHOD", "PUSH_METHOD", "SERVICE", "ConnectionBatches",
           "NodeBatch", "batch_methods", "batching_stub", "current_batches", "install", "serve"]
