"""The ServerApp's object requests and reply polls answered without FastAPI's per-request
machinery.

Flower 1.39's ServerApp reaches the SuperLink over the Runtime HTTP API with one request per
object it pushes or pulls and one per reply it confirms: ~5 of the ~6 Runtime API requests per
silo and round on the quick example (bench/RESULTS.md, request counts). Each one passes
uvicorn, Starlette's middleware stack, FastAPI's routing and dependency solving, a hop to a
worker thread and Flower's protobuf translation, all on the SuperLink's event-loop thread,
which took about half of the SuperLink's CPU in gRPC rounds, on the cores the silos train on.

:class:`ObjectRequestsFastPath` answers those three routes (``pull-object``, ``push-object``,
``confirm-message-received``) and the ServerApp's reply poll (``pull-messages``, ~13 requests a
round on the quick example, which went through all of the above: about a quarter of the
SuperLink's HTTP-side CPU in a profiled gRPC run) itself, with what Flower's route would use:
the same protobuf request and response bodies, the same Runtime version check, the same
task-token rule (exactly one token header naming a task in the state), the same handler of
Flower's Runtime API on the same state, and Flower's own error translation when the handler
fails. A request it cannot answer that way (another content type, a body that does not parse,
an incompatible caller, a missing or unknown token) goes through Flower's full app before any
handler has run, so Flower gives its own answer or error. Any other request goes through
Flower's app untouched. It is installed only while the tuning is on
(:mod:`dpcfl_flwr.flower_compat`), and only when no middleware of an extension or an event-log
plugin would have seen these requests.

It also answers the three batch routes of :mod:`.object_batches` (``dpcfl-pull-objects``,
``dpcfl-push-objects``, ``dpcfl-confirm-messages``), which Flower's app does not have: a batch
of serialised ``pull-object``, ``push-object`` or ``confirm-message-received`` requests under
one token, each answered by the same handler as alone, in order. A batch it cannot answer (more than
:data:`~.object_batches.MAX_BATCH_ITEMS` requests among them) goes to Flower's app, which
answers 404, and the ServerApp falls back to one request per object.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from .object_batches import BATCH_ROUTES, MAX_BATCH_ITEMS, ObjectBatch

RUNTIME_PREFIX = "/v1/runtime/"
# route -> (module in flwr.proto, request type name in it, handler name in Flower's handlers),
# as Flower's Runtime router declares each route
FAST_ROUTES = {
    "pull-object": ("message_pb2", "PullObjectRequest", "pull_object"),
    "push-object": ("message_pb2", "PushObjectRequest", "push_object"),
    "confirm-message-received": ("message_pb2", "ConfirmMessageReceivedRequest",
                                 "confirm_message_received"),
    "pull-messages": ("runtime_pb2", "PullAppMessagesRequest", "pull_messages"),
}

Receive = Callable[[], Awaitable[dict[str, Any]]]


class _FlowersToAnswer(BaseException):  # noqa: N818 - a signal, not an error
    """Raised in the worker thread when the token names no task: Flower's app answers. A
    BaseException, because Flower's error translator turns every Exception into a 500."""


async def _read_body(receive: Receive) -> bytes | None:
    """The request's body; None when the caller went away before sending all of it."""
    chunks = []
    while True:
        event = await receive()
        if event["type"] != "http.request":
            return None
        chunks.append(event.get("body", b""))
        if not event.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands the already-read body over once more, then the caller's events."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class ObjectRequestsFastPath:
    """Pure ASGI, outside Flower's SuperLink app (``app``): see the module docstring."""

    def __init__(self, app: Any) -> None:
        import importlib

        from flwr.proto import message_pb2  # pylint: disable=E0611
        from flwr.supercore.constant import TASK_TOKEN_HEADER
        from flwr.supercore.error import FlowerError
        from flwr.supercore.error.http import http_error_translator
        from flwr.supercore.protobuf.constants import PROTOBUF_MEDIA_TYPE
        from flwr.superlink import main as superlink_main
        from google.protobuf.message import DecodeError

        self.app = app
        self.state = app.state  # Starlette's State of Flower's app: its factory and handlers
        # path -> (request type, handler name, whether the body is a batch of such requests)
        self.routes = {
            RUNTIME_PREFIX + route: (
                getattr(importlib.import_module(f"flwr.proto.{module}"), request), handler, False)
            for route, (module, request, handler) in FAST_ROUTES.items()}
        self.routes.update({RUNTIME_PREFIX + route: (getattr(message_pb2, request), handler, True)
                            for route, (request, handler) in BATCH_ROUTES.items()})
        # the check Flower's Runtime router depends on, itself
        self.check_version = superlink_main._RUNTIME_VERSION_DEPENDENCY.dependency
        self.refusals = (DecodeError, FlowerError)
        self.token_header, self.media_type = TASK_TOKEN_HEADER, PROTOBUF_MEDIA_TYPE
        self.translate_errors = http_error_translator

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        route = (self.routes.get(scope["path"])
                 if scope["type"] == "http" and scope["method"] == "POST" else None)
        if route is None:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # nobody to answer
        request = Request(scope)
        request_type, handler_name, batched = route
        parsed = self._parsed(request, body, request_type, batched)
        if parsed is not None:
            messages, token = parsed
            handler = getattr(self.state.runtime_handlers, handler_name)

            def work() -> Any:  # a database state may wait on its lock: not on the event loop
                state = self.state.runtime_state_factory.state()
                task = state.get_task_by_token(token)
                if task is None:
                    raise _FlowersToAnswer
                if not batched:
                    return handler(messages[0], state, task)
                return ObjectBatch(items=[handler(message, state, task).SerializeToString()
                                          for message in messages])

            async def answer(_: Request) -> Response:
                result = await run_in_threadpool(work)
                return Response(content=result.SerializeToString(), media_type=self.media_type)

            try:
                response = await self.translate_errors(request, answer)
            except _FlowersToAnswer:
                pass
            else:
                await response(scope, receive, send)
                return
        await self.app(scope, _replaying(body, receive), send)

    def _parsed(self, request: Request, body: bytes, request_type: Any, batched: bool
                ) -> tuple[list[Any], str] | None:
        """(the protobuf requests: one, or a batch's, its task token), or None when Flower's
        app must answer (for a batch route: that it has no such route)."""
        content_type = request.headers.get("content-type", "")
        tokens = request.headers.getlist(self.token_header)
        if content_type.partition(";")[0].strip().lower() != self.media_type or (
                len(tokens) != 1 or not tokens[0]):
            return None
        try:
            items = ObjectBatch.FromString(body).items if batched else [body]
            if len(items) > MAX_BATCH_ITEMS:  # larger than the ServerApp ever sends
                return None
            messages = [request_type.FromString(item) for item in items]
            self.check_version(request)
        except self.refusals:
            return None
        return messages, tokens[0]


def install() -> bool:
    """Put the fast path around the app ``flower-superlink`` serves; False (nothing changed)
    with the tuning off, or when an extension or event-log plugin is configured."""
    from . import gate

    if not gate.TUNING:
        return False
    from flwr.superlink import extensions
    from flwr.superlink import main as superlink_main

    if extensions.get_middleware():
        return False
    create_app = superlink_main.create_app

    def create_app_with_fast_path(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        if app.state.control_event_log_plugin is not None:
            return app
        return ObjectRequestsFastPath(app)

    superlink_main.create_app = create_app_with_fast_path
    return True
