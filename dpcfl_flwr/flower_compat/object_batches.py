"""A ServerApp's message objects moved in one Runtime API request each way, not one per object,
and the replies a poll brings confirmed in one request, not one per reply.

Flower 1.39's ServerApp (``HttpGrid``) pushes every object of a round's messages with its own
``push-object`` request and pulls every object of each reply with its own ``pull-object``
request. On the quick example a message has 3 objects (the message, its RecordDict, its
ConfigRecord with the model's bytes), so a 21-silo round took ~27 pushes and 63 pulls, about
two thirds of the ServerApp's ~140 Runtime API requests a round (bench/RESULTS.md). Each is an
HTTPS request that the ServerApp and the SuperLink both serve in Python, on the cores the silos
train on.

Here a batch carries many such requests: an :data:`ObjectBatch` holds the serialised
``PullObjectRequest`` (``PushObjectRequest``, ``ConfirmMessageReceivedRequest``) messages, and
the SuperLink's fast path (:mod:`.runtime_fast_path`) answers each with Flower's own handler,
in order, under the batch's one task token, and returns their serialised responses in a batch
of its own. Every sub-request is therefore checked exactly as it would be alone. A batch holds
at most :data:`MAX_BATCH_ITEMS` requests and about :data:`MAX_BATCH_BYTES` of object content.

On the ServerApp's side (:func:`install`), the two helpers Flower's ``HttpGrid`` module calls
(``pull_objects``, ``push_objects``) are replaced, in that module only, by ones that send
batches when the object function comes from the grid's own Runtime API client, and otherwise
call Flower's. A poll that brings several replies has all their objects pulled in one batch as
its answer arrives (``HttpGrid.pull_messages``); Flower's per-reply pulls then take them from
there. Flower then confirms each reply with a request of its own as it takes it; those
confirmations are held and go in one batch once the poll's replies are all taken. A round's
replies come in a burst at its end, several a poll, and the ServerApp's requests follow one
another, so one confirmation per reply lengthened the round's tail: on the quick example over
gRPC the last round's overhead went from 16-17% to 15% (bench/RESULTS.md). A reply is still
confirmed once it is in the ServerApp's hands, as in Flower's order; should taking the replies
fail, the ones taken are confirmed all the same. What Flower's helpers promise stays: an object
the SuperLink does not know raises ``ObjectPullError``, one it refuses to store
``ObjectPushError``; objects not yet available are pulled again by Flower's own helper, with
its back-off and time limit; pushed objects leave the dictionary unless asked to stay. A
SuperLink without the batch routes (stock Flower, or ours with the tuning off) answers a batch
with an error status: the grid then goes back to Flower's one request per object for the rest
of the process.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

logger = logging.getLogger(__name__)

#: Route -> (request type name in flwr.proto.message_pb2, handler name in Flower's Runtime API
#: handlers). Not Flower routes: a SuperLink without them answers 404.
BATCH_ROUTES = {
    "dpcfl-pull-objects": ("PullObjectRequest", "pull_object"),
    "dpcfl-push-objects": ("PushObjectRequest", "push_object"),
    "dpcfl-confirm-messages": ("ConfirmMessageReceivedRequest", "confirm_message_received"),
}
MAX_BATCH_ITEMS = 256
MAX_BATCH_BYTES = 16 * 1024 * 1024  # object content per push batch (an object may pass it)
NO_SUCH_ROUTE = frozenset({404, 405})


def _object_batch_type() -> type:
    """``dpcfl.ObjectBatch {repeated bytes items = 1;}``: serialised requests or responses."""
    file = descriptor_pb2.FileDescriptorProto(name="dpcfl/object_batch.proto", package="dpcfl",
                                              syntax="proto3")
    batch = file.message_type.add(name="ObjectBatch")
    batch.field.add(name="items", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                    label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("dpcfl.ObjectBatch"))


ObjectBatch: Any = _object_batch_type()


class _BatchSender:
    """Sends batches over one ``RuntimeHttpClient``, until its SuperLink shows it has no batch
    routes."""

    _without_routes: weakref.WeakSet[Any] = weakref.WeakSet()  # clients whose SuperLink has none

    def __init__(self, client: Any) -> None:
        self.client = client

    def usable(self) -> bool:
        return self.client not in self._without_routes

    def send(self, route: str, items: list[bytes]) -> list[bytes] | None:
        """The serialised responses to ``items`` in order, or None when the SuperLink did not
        answer the batch as one: Flower's one request per object then gives Flower's answer
        (a SuperLink without the routes is not asked for batches again)."""
        import httpx

        try:
            answer = self.client._unary_unary(  # pylint: disable=protected-access
                path=f"/v1/runtime/{route}", rpc_method=f"/dpcfl.Runtime/{route}",
                request=ObjectBatch(items=items), response_type=ObjectBatch)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code in NO_SUCH_ROUTE:
                self._without_routes.add(self.client)
                logger.info("the SuperLink takes no object batches (HTTP %s): one request per "
                            "object from now on", exc.response.status_code)
            return None
        if len(answer.items) != len(items):
            raise RuntimeError(f"the SuperLink answered {len(answer.items)} of a batch of "
                               f"{len(items)} object requests")
        return list(answer.items)


class BatchablePull:
    """Flower's pull-object function of one grid (``make_pull_object_fn_protobuf``), which
    also knows the client, node and run to pull a batch with."""

    def __init__(self, flowers: Callable[[str], bytes], pull: Callable[..., Any], node: Any,
                 run_id: int) -> None:
        self.flowers, self.sender = flowers, _BatchSender(pull.__self__)  # type: ignore[attr-defined]
        self.node, self.run_id = node, run_id

    def __call__(self, object_id: str) -> bytes:
        return self.flowers(object_id)


class BatchablePush:
    """Flower's push-object function of one grid (``make_push_object_fn_protobuf``), which
    also knows the client, node, run and session to push a batch with."""

    def __init__(self, flowers: Callable[[str, bytes], None], push: Callable[..., Any],
                 node: Any, run_id: int, session_id: str) -> None:
        self.flowers, self.sender = flowers, _BatchSender(push.__self__)  # type: ignore[attr-defined]
        self.node, self.run_id, self.session_id = node, run_id, session_id

    def __call__(self, object_id: str, object_content: bytes) -> None:
        self.flowers(object_id, object_content)


def _pull_batched(flowers_pull_objects: Callable[..., dict[str, bytes]],
                  object_ids: list[str], pull: BatchablePull, **options: Any
                  ) -> dict[str, bytes] | None:
    """The objects' contents by id, pulled in batches; None (nothing pulled) when the
    SuperLink did not answer the first batch."""
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PullObjectRequest,
        PullObjectResponse,
    )
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

    contents: dict[str, bytes] = {}
    later: list[str] = []  # not stored yet, or not answered in a batch
    for start in range(0, len(object_ids), MAX_BATCH_ITEMS):
        part = object_ids[start:start + MAX_BATCH_ITEMS]
        answers = pull.sender.send("dpcfl-pull-objects", [PullObjectRequest(
            node=pull.node, run_id=pull.run_id, object_id=object_id).SerializeToString()
            for object_id in part])
        if answers is None:
            if start == 0:
                return None
            later += object_ids[start:]
            break
        for object_id, raw in zip(part, answers, strict=True):
            response = PullObjectResponse.FromString(raw)
            if not response.object_found:
                raise ObjectPullError(object_id, "the object could not be found.")
            if response.object_available:
                contents[object_id] = response.object_content
            else:
                later.append(object_id)
    if later:  # Flower's own pulls, with its back-off and time limit
        contents.update(flowers_pull_objects(later, pull, **options))
    return contents


def _deflated(objects: dict[str, Any], wanted: set[str] | None) -> Iterator[tuple[str, bytes]]:
    """(id, content) of the objects to push, in the order Flower's ``push_objects`` sends."""
    for object_id in list(objects):
        if wanted is None or object_id in wanted:
            yield object_id, objects[object_id].deflate()


def batches_of(contents: Iterable[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    """``contents`` in runs of at most MAX_BATCH_ITEMS and (but for a single larger object)
    MAX_BATCH_BYTES."""
    batch: list[tuple[str, bytes]] = []
    size = 0
    for object_id, content in contents:
        if batch and (len(batch) == MAX_BATCH_ITEMS or size + len(content) > MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append((object_id, content))
        size += len(content)
    if batch:
        yield batch


def _push_batched(objects: dict[str, Any], push: BatchablePush, wanted: set[str] | None,
                  keep: bool) -> bool:
    """Push the objects in batches and drop them from ``objects`` unless ``keep``; False
    (nothing pushed or dropped) when the SuperLink did not answer the first batch."""
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PushObjectRequest,
        PushObjectResponse,
    )
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    pushed: list[str] = []
    for batch in batches_of(_deflated(objects, wanted)):
        answers = push.sender.send("dpcfl-push-objects", [PushObjectRequest(
            node=push.node, run_id=push.run_id, session_id=push.session_id,
            object_id=object_id, object_content=content).SerializeToString()
            for object_id, content in batch])
        if answers is None and not pushed:
            return False
        for index, (object_id, content) in enumerate(batch):
            if answers is None:  # the SuperLink stopped taking batches: one at a time
                push.flowers(object_id, content)
            elif not PushObjectResponse.FromString(answers[index]).stored:
                raise ObjectPushError(object_id, push.run_id, push.session_id)
            pushed.append(object_id)
    if not keep:
        for object_id in pushed:
            del objects[object_id]
    return True


#: Objects of the replies a poll brought, pulled in one batch as its answer arrived: Runtime
#: API client -> object id -> content, until Flower's per-reply pulls take them.
_prefetched: weakref.WeakKeyDictionary[Any, dict[str, bytes]] = weakref.WeakKeyDictionary()


def _prefetch(sender: _BatchSender, node: Any, run_id: int, response: Any) -> dict[str, bytes]:
    """The available objects of every reply in ``response`` (a PullAppMessagesResponse),
    pulled in batches; what a batch did not bring is left to the per-reply pulls."""
    from flwr.proto.message_pb2 import (  # pylint: disable=E0611
        PullObjectRequest,
        PullObjectResponse,
    )
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree

    object_ids = list(dict.fromkeys(tree.object_id for root in response.message_object_trees
                                    for tree in iterate_object_tree(root)))
    contents: dict[str, bytes] = {}
    for start in range(0, len(object_ids), MAX_BATCH_ITEMS):
        part = object_ids[start:start + MAX_BATCH_ITEMS]
        answers = sender.send("dpcfl-pull-objects", [PullObjectRequest(
            node=node, run_id=run_id, object_id=object_id).SerializeToString()
            for object_id in part])
        if answers is None:
            break
        for object_id, raw in zip(part, answers, strict=True):
            answer = PullObjectResponse.FromString(raw)
            if answer.object_found and answer.object_available:
                contents[object_id] = answer.object_content
    return contents


def _confirm_batched(sender: _BatchSender, flowers_confirm: Callable[[Any], Any],
                     confirmations: list[Any]) -> None:
    """Send these ``ConfirmMessageReceivedRequest`` in batches; one alone, or the rest where
    the SuperLink did not answer a batch, with Flower's own request (and its error)."""
    rest = confirmations
    while len(rest) > 1 and sender.usable():
        part = rest[:MAX_BATCH_ITEMS]
        if sender.send("dpcfl-confirm-messages",
                       [confirmation.SerializeToString() for confirmation in part]) is None:
            break
        rest = rest[len(part):]
    for confirmation in rest:
        flowers_confirm(confirmation)


def _batchable(client_call: Callable[..., Any]) -> bool:
    """Whether ``client_call`` is a method of a Runtime API client that can send a batch."""
    return hasattr(getattr(client_call, "__self__", None), "_unary_unary")


def install() -> bool:
    """Make Flower's ``HttpGrid`` (the ServerApp's grid in a deployment) move its objects in
    batches; False when it did already."""
    from flwr.superlink.grid import http_grid

    if http_grid.pull_objects.__module__ == __name__:
        return False
    flowers_pull_objects, flowers_push_objects = http_grid.pull_objects, http_grid.push_objects
    make_pull, make_push = (http_grid.make_pull_object_fn_protobuf,
                            http_grid.make_push_object_fn_protobuf)

    def pull_objects(object_ids: list[str], pull_object_fn: Callable[[str], bytes],
                     **options: Any) -> dict[str, bytes]:
        if isinstance(pull_object_fn, BatchablePull):
            ready = _prefetched.get(pull_object_fn.sender.client, {})
            have = {i: ready.pop(i) for i in object_ids if i in ready}
            rest = [i for i in object_ids if i not in have]
            if not rest:
                return have
            if pull_object_fn.sender.usable():
                contents = _pull_batched(flowers_pull_objects, rest, pull_object_fn, **options)
                if contents is not None:
                    return {**have, **contents}
            return {**have, **flowers_pull_objects(rest, pull_object_fn, **options)}
        return flowers_pull_objects(object_ids, pull_object_fn, **options)  # type: ignore

    def push_objects(objects: dict[str, Any], push_object_fn: Callable[[str, bytes], None], *,
                     object_ids_to_push: set[str] | None = None, keep_objects: bool = False,
                     **options: Any) -> None:
        if (isinstance(push_object_fn, BatchablePush) and push_object_fn.sender.usable()
                and _push_batched(objects, push_object_fn, object_ids_to_push, keep_objects)):
            return
        flowers_push_objects(objects, push_object_fn, object_ids_to_push=object_ids_to_push,
                             keep_objects=keep_objects, **options)

    def make_pull_object_fn(*, pull_object_protobuf: Callable[..., Any], node: Any,
                            run_id: int) -> Callable[[str], bytes]:
        flowers = make_pull(pull_object_protobuf=pull_object_protobuf, node=node, run_id=run_id)
        if not _batchable(pull_object_protobuf):
            return flowers  # type: ignore[no-any-return]
        return BatchablePull(flowers, pull_object_protobuf, node, run_id)

    def make_push_object_fn(*, push_object_protobuf: Callable[..., Any], node: Any,
                            run_id: int, session_id: str) -> Callable[[str, bytes], None]:
        flowers = make_push(push_object_protobuf=push_object_protobuf, node=node, run_id=run_id,
                            session_id=session_id)
        if not _batchable(push_object_protobuf):
            return flowers  # type: ignore[no-any-return]
        return BatchablePush(flowers, push_object_protobuf, node, run_id, session_id)

    flowers_pull_messages = getattr(http_grid.HttpGrid.pull_messages, "__wrapped__",
                                    http_grid.HttpGrid.pull_messages)

    def pull_messages(self: Any, message_ids: Iterable[str]) -> Any:
        client = self._runtime_client
        sender = _BatchSender(client)
        if not _batchable(client.PullMessages) or not sender.usable():
            return flowers_pull_messages(self, message_ids)
        flowers_poll = client.PullMessages

        def poll_and_prefetch(request: Any) -> Any:
            response = flowers_poll(request)
            if len(response.messages_list) > 1:  # one reply: its own batch is as cheap
                _prefetched[client] = _prefetch(sender, self.node, self._run.run_id, response)
            return response

        flowers_confirm = client.ConfirmMessageReceived
        confirmations: list[Any] = []
        client.PullMessages = poll_and_prefetch  # for this call only
        client.ConfirmMessageReceived = confirmations.append  # Flower ignores its answer
        try:
            return flowers_pull_messages(self, message_ids)
        finally:
            del client.PullMessages, client.ConfirmMessageReceived
            _prefetched.pop(client, None)
            _confirm_batched(sender, flowers_confirm, confirmations)

    pull_messages.__wrapped__ = flowers_pull_messages  # type: ignore[attr-defined]
    http_grid.HttpGrid.pull_messages = pull_messages  # type: ignore[method-assign]
    http_grid.make_pull_object_fn_protobuf = make_pull_object_fn  # type: ignore[assignment]
    http_grid.make_push_object_fn_protobuf = make_push_object_fn  # type: ignore[assignment]
    http_grid.pull_objects = pull_objects  # type: ignore[assignment]
    http_grid.push_objects = push_objects  # type: ignore[assignment]
    return True


__all__ = ["BATCH_ROUTES", "MAX_BATCH_BYTES", "MAX_BATCH_ITEMS", "BatchablePull",
           "BatchablePush", "ObjectBatch", "batches_of", "install"]
