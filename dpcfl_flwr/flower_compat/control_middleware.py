"""The SuperLink's Control-API middleware kept off the Runtime API's requests.

Flower 1.39 serves the Control API (``flwr run``, ``flwr log``) and the Runtime API (the
ServerApp's messages and objects, one request per object) from one FastAPI app, and runs every
request through all six of its middlewares. Four of them act on Control paths only and pass
any other request straight on, but each is a Starlette ``BaseHTTPMiddleware``: a task group,
two memory streams and a wrapped response per layer, per request. The ServerApp of a 21-silo
round makes ~200 Runtime API requests (most of them one per object it pulls); past the four
layers a request costs 1.1 instead of 1.8 ms of CPU (bench/runtime_api_requests.py, which
includes its test client's share). :class:`ControlPathsOnly` runs such a middleware for the
requests it can act on and hands every other one to the next layer directly; what a request
gets from the middleware is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTROL_PREFIX = "/v1/control/"


def _control_path(scope: dict[str, Any]) -> bool:
    return scope["type"] != "http" or scope["path"].startswith(CONTROL_PREFIX)


def _control_path_or_event_log(scope: dict[str, Any]) -> bool:
    # Flower's event-log middleware logs any parsed protobuf request once a plugin is set
    app = scope.get("app")
    plugin = getattr(getattr(app, "state", None), "control_event_log_plugin", None)
    return plugin is not None or _control_path(scope)


class ControlPathsOnly:
    """Pure ASGI: ``middleware`` for the requests ``acts_on`` accepts, the next layer else."""

    def __init__(self, app: Any, middleware: Any, acts_on: Callable[[dict[str, Any]], bool]
                 ) -> None:
        self.app = app
        self.middleware = middleware(app)
        self.acts_on = acts_on

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.acts_on(scope):
            await self.middleware(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def install() -> bool:
    """Wrap the Control-only middlewares of the app ``flwr.superlink.main`` builds; False
    (nothing changed) with the tuning off: another Flower's middlewares may act differently."""
    from . import gate

    if not gate.TUNING:
        return False
    from flwr.superlink import main as superlink_main
    from flwr.superlink.routers.control import middlewares as control
    from starlette.middleware import Middleware

    acts_on: dict[Any, Callable[[dict[str, Any]], bool]] = {
        control.ControlSensitiveResponseMiddleware: _control_path,
        control.ControlAuthenticationMiddleware: _control_path,
        control.ControlLicenseMiddleware: _control_path,
        control.ControlEventLogMiddleware: _control_path_or_event_log}
    flower_middleware = superlink_main._get_middleware

    def lean_middleware() -> list[Any]:
        return [Middleware(ControlPathsOnly, middleware=m.cls, acts_on=acts_on[m.cls])
                if m.cls in acts_on else m for m in flower_middleware()]

    superlink_main._get_middleware = lean_middleware
    return True


def superlink_app() -> Any:
    """The SuperLink's FastAPI app as ``flwr.superlink.main`` builds it now (Flower's stack,
    or the lean one after :func:`install`): what bench/runtime_api_requests.py times."""
    from flwr.superlink import main as superlink_main

    return superlink_main.create_app()
