"""The SuperLink's Control-API middleware is kept off Runtime API requests and nothing a
request gets changes: Flower's real SuperLink app, built with and without the change, answers
the same requests the same way, and the Control middlewares still see every Control request.
"""

from __future__ import annotations

import pytest
from flwr.superlink import main as superlink_main
from flwr.superlink.routers.control import middlewares as control
from starlette.testclient import TestClient

from dpcfl_flwr import flower_compat
from dpcfl_flwr.flower_compat import control_middleware

CONTROL_ONLY = (control.ControlSensitiveResponseMiddleware,
                control.ControlAuthenticationMiddleware,
                control.ControlLicenseMiddleware,
                control.ControlEventLogMiddleware)
REQUESTS = [("POST", "/v1/runtime/pull-object"),  # no task token: refused
            ("POST", "/v1/runtime/pull-messages"),
            ("POST", "/v1/control/get-login-details"),  # sensitive: no-store headers
            ("POST", "/v1/control/list-runs"),
            ("GET", "/health")]


@pytest.fixture
def entered(monkeypatch):
    """Which Control middlewares a request entered (Flower's own dispatch still runs)."""
    calls: list[str] = []
    for cls in CONTROL_ONLY:
        def counted(self, request, call_next, _cls=cls, _dispatch=cls.dispatch):
            calls.append(_cls.__name__)
            return _dispatch(self, request, call_next)
        monkeypatch.setattr(cls, "dispatch", counted)
    # install() replaces the module's function: restore it after the test
    monkeypatch.setattr(superlink_main, "_get_middleware", superlink_main._get_middleware)
    return calls


def answers(app, calls: list[str]) -> list[tuple]:
    """(status, content type, cache headers, body, Control middlewares entered) per request."""
    out = []
    with TestClient(app) as client:
        for method, path in REQUESTS:
            calls.clear()
            response = client.request(method, path, content=b"",
                                      headers={"content-type": "application/protobuf"})
            # list-runs reports the time of the call: compare everything else
            body = b"" if path.endswith("list-runs") else response.content
            out.append((path, response.status_code, response.headers.get("content-type"),
                        response.headers.get("cache-control"), body, sorted(calls)))
    return out


def test_runtime_requests_skip_the_control_middlewares_and_get_the_same_answers(entered):
    flowers = answers(superlink_main.create_app(), entered)
    assert control_middleware.install()
    ours = answers(superlink_main.create_app(), entered)
    every = sorted(cls.__name__ for cls in CONTROL_ONLY)
    for (path, *flower_answer, flower_entered), (_, *our_answer, our_entered) in zip(
            flowers, ours, strict=True):
        assert our_answer == flower_answer, path
        assert flower_entered == every  # Flower runs all four on every request
        assert our_entered == (every if path.startswith("/v1/control/") else []), path
    assert flowers[0][1] == 401 and flowers[2][3] == "no-store"


def test_with_an_event_log_plugin_runtime_requests_are_still_logged(entered):
    assert control_middleware.install()
    app = superlink_main.create_app()

    class Plugin:  # the interface Flower's event-log middleware calls
        def __init__(self) -> None:
            self.written: list = []

        def compose_log_before_event(self, **kwargs):
            return ("before", kwargs["method_name"])

        def compose_log_after_event(self, **kwargs):
            return ("after", kwargs["method_name"])

        def write_log(self, entry) -> None:
            self.written.append(entry)

    plugin = Plugin()
    app.state.control_event_log_plugin = plugin
    with TestClient(app) as client:
        client.post("/v1/runtime/pull-object", content=b"",
                    headers={"content-type": "application/protobuf"})
    assert entered == ["ControlEventLogMiddleware"]
    assert plugin.written[0] == ("before", "/v1/runtime/pull-object")


def test_other_flower_versions_keep_their_middleware(entered, monkeypatch):
    flowers = superlink_main._get_middleware
    monkeypatch.setattr(flower_compat.gate, "TUNING", False)
    assert not control_middleware.install()
    assert superlink_main._get_middleware is flowers
    monkeypatch.setattr(flower_compat.gate, "TUNING", True)
    assert control_middleware.install() and superlink_main._get_middleware is not flowers
