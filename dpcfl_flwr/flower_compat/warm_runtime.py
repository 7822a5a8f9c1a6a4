"""A silo's ClientApp runtime: every task of its SuperNode, answered by trusted code only.

Flower 1.39's SuperExec starts a fresh ``flwr-clientapp`` process for every message, and that
process runs whatever code the FAB ships; the FAB comes from the server, which a silo does not
trust. :class:`WarmRuntime` takes the SuperExec's place next to ``flower-supernode --isolation
process``: it acquires the SuperNode's tasks over the Runtime API and first checks each task's
FAB against the app installed on the silo (:mod:`dpcfl_flwr.app_pin`). A task whose FAB ships
other code is refused: its message is answered with an Error (``INVALID_FAB``, the reason) and
nothing of the FAB runs. A trusted task is answered

- warm (the default): with Flower's own task I/O (``flwr.supernode.runtime.run_clientapp``)
  by the ClientApp loaded in this process, so imports, the loaded ClientApp and the silo's
  cached data outlive a message. On the quick example the per-message start-up of a fresh
  process was ~95% of a gRPC round (bench/RESULTS.md, "Framework overhead");
- or per message (``per_message=True``): by Flower's ``flwr-clientapp``, started for that one
  task, which installs the FAB (now known to be the installed code) and runs it.

The Context (with the ledger record) still arrives with every task, and the ledger on disk is
written exactly as before. A silo runs the runtime inside its SuperNode's process
(:mod:`.direct_runtime`, what ``dpcfl client`` starts), where the FAB is read from the
SuperNode's state before the task is taken; ``python -m dpcfl_flwr.flower_compat.warm_runtime`` runs
a warm runtime as a process of its own, over the SuperNode's local HTTP API, and checks the FAB
that comes with the task's input before the ClientApp sees the message.
"""

# ruff: noqa: E402 - the gate's check runs before the internal imports

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import cast

from .gate import require_pin

require_pin(__name__)  # the gate runs before the internal imports below

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import FAB_HASH_TRUNCATION, ErrorCode, SubStatus
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    PullObjectRequest,
    PullObjectResponse,
)
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.protobuf.client import ProtobufClientInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

from .. import app_pin
from ..runs.heap import reply_first
from .environment import flower_tool

logger = logging.getLogger(__name__)

# Polling is the fallback when something wakes the runtime as soon as its SuperNode has stored
# a message (``wake``; in the SuperNode's process, its loop does). A separate process has no
# such signal and polls every second: an AcquireTask is ~1-3 ms on each side, and 21 silos at
# 10 Hz took about a third of this 2-core machine.
DEFAULT_POLL_SECONDS = 1.0
WOKEN_POLL_SECONDS = 10.0
REFUSED = "refused FAB"  # how every refusal line starts (the deployment tests look for it)

# token (None: the SuperExec's own, task-less calls) -> a Runtime API client for it (Flower's
# HTTP client, or one with its methods: direct_runtime.DirectRuntimeClient)
Connect = Callable[[str | None], RuntimeHttpClient]
# a task -> (its FAB's hash, why that FAB must not run here or None), read without taking the
# task (direct_runtime.fab_check)
FabCheck = Callable[[Task], tuple[str, str | None]]


class StaleTask(Exception):
    """A task whose message will not arrive whole: its SuperNode dropped it, or a message of
    another run waits behind it (the run it belongs to was interrupted)."""


class _WhileWanted:
    """A task's Runtime API client whose object pulls stop once the task is stale.

    Flower's task input pull retries an object that has not arrived for up to two hours. One
    runtime answers its silo's tasks one at a time, so a message left over from a run that was
    stopped mid-round (its objects never arrive) held up every later run of the silo. Each
    retry asks ``alive()`` (the SuperNode's view, :meth:`.direct_runtime.DirectRuntimeClient.
    task_alive`) first: a stale task ends at the next retry, within seconds."""

    def __init__(self, client: RuntimeHttpClient, alive: Callable[[], bool]) -> None:
        self._client = client
        self._alive = alive

    def PullObject(self, request: PullObjectRequest) -> PullObjectResponse:  # noqa: N802
        response = self._client.PullObject(request)
        if response.object_found and not response.object_available and not self._alive():
            raise StaleTask("its message did not arrive whole and the SuperNode no longer "
                            "waits for it (the run was stopped or interrupted)")
        return response

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)


def http_link(address: str) -> Connect:
    """Clients of the SuperNode's local HTTP Runtime API, as Flower's SuperExec makes them."""
    def connect(token: str | None) -> RuntimeHttpClient:
        interceptors: list[ProtobufClientInterceptor] = [
            RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        return RuntimeHttpClient.from_server_address(
            server_address=address, insecure=True, root_certificates=None,
            interceptors=interceptors, retry_invoker=make_simple_http_retry_invoker())
    return connect


class WarmRuntime:
    """Acquire a SuperNode's ClientApp tasks; refuse those whose FAB is not the installed app,
    answer the others in this process or, ``per_message``, in a fresh ``flwr-clientapp``
    (see module doc). ``per_message`` needs ``check_fab``: the FAB must be judged before
    ``flwr-clientapp`` takes the task."""

    def __init__(self, runtime_api_address: str, app: ClientApp | None,
                 poll_seconds: float = DEFAULT_POLL_SECONDS,
                 connect: Connect | None = None,
                 on_task_done: Callable[[], None] | None = None,
                 check_fab: FabCheck | None = None,
                 per_message: bool = False) -> None:
        if per_message and check_fab is None:
            raise ValueError("a per-message runtime must check each FAB before its task runs")
        if not per_message and app is None:
            raise ValueError("a warm runtime needs its ClientApp")
        self.address = runtime_api_address
        self.app = app
        self.poll_seconds = poll_seconds
        self.connect: Connect = connect or http_link(runtime_api_address)
        self.on_task_done = on_task_done  # e.g. wake the SuperNode to send the reply
        self.check_fab = check_fab
        self.per_message = per_message
        self.verdicts: dict[str, str | None] = {}  # FAB hash -> refusal (None: trusted)
        self.wake = threading.Event()  # set when the SuperNode has a message for this silo

    def serve(self) -> None:
        acquirer = self.connect(None)
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
        try:
            while True:
                acquired = acquirer.AcquireTask(request)
                if acquired.HasField("task") and acquired.token:
                    self.run(acquired.task, acquired.token)
                else:
                    self.wake.wait(self.poll_seconds)
                    self.wake.clear()
        finally:
            acquirer.close()

    def run(self, task: Task, token: str) -> None:
        """Answer the task; the app's clean-up that waits for the reply (runs/heap.py) runs
        once the reply is stored and the SuperNode told, so the reply leaves first."""
        with reply_first():
            try:
                self._run(task, token)
            finally:
                if self.on_task_done is not None:
                    self.on_task_done()

    def _run(self, task: Task, token: str) -> None:
        refused = self._judge_ahead(task)
        if refused is not None:
            self._answer(token, refused=refused)
        elif self.per_message:
            self._run_fresh_process(token)
        else:
            self._answer(token)

    def _judge_ahead(self, task: Task) -> str | None:
        if self.check_fab is None:
            return None  # judged on the FAB that comes with the task's input (_answer)
        try:
            fab_hash, refused = self.check_fab(task)
        except Exception as exc:  # noqa: BLE001 - refused, not run: fail closed
            logger.exception("could not read the FAB of run %d", task.run_id)
            return f"the FAB could not be read ({exc})"
        return self._verdict(fab_hash, refused)

    def _verdict(self, fab_hash: str, refused: str | None) -> str | None:
        """Log the verdict on a FAB the first time it is seen: one line per FAB."""
        if fab_hash not in self.verdicts:
            self.verdicts[fab_hash] = refused
            if refused is None:
                logger.info("FAB %s ships the installed app; its messages are answered %s",
                            fab_hash[:FAB_HASH_TRUNCATION],
                            "by one process each" if self.per_message else "in this process")
            else:
                logger.error("%s %s: %s; its messages are answered with an error and none of "
                             "its code runs (this silo runs only the app installed on it)",
                             REFUSED, fab_hash[:FAB_HASH_TRUNCATION], refused)
        return refused

    def _run_fresh_process(self, token: str) -> None:
        """Flower's own path for a trusted FAB: a fresh ``flwr-clientapp`` for this one task."""
        command = flower_tool("flwr-clientapp") or "flwr-clientapp"
        subprocess.run([command, "--runtime-api-address", self.address, "--token", token,
                        "--insecure", "--parent-pid", str(os.getpid())], check=False)

    def _answer(self, token: str, refused: str | None = None) -> None:
        """``run_clientapp`` without the process around it: same pulls, pushes and statuses;
        with ``refused`` (or a FAB in the task's input that is not the installed app), the
        message is answered with an Error and the ClientApp never sees it."""
        client = self.connect(token)
        heartbeat = HeartbeatSender(getattr(client, "task_heartbeat", None)
                                    or make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message: Message | None = None
        context: Context | None = None
        reply: Message | None = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        started = time.perf_counter()
        alive = getattr(client, "task_alive", None)  # in the SuperNode's process only
        try:
            message, context, run, fab = pull_task_input(
                client if alive is None else cast(RuntimeHttpClient, _WhileWanted(client, alive)))
            if refused is None and self.check_fab is None:
                refused = self._verdict(app_pin.fab_hash(fab.content), app_pin.refusal(
                    fab.content, run.fab_id, run.fab_version))
            if refused is not None:
                details = f"{REFUSED}: {refused}"
                reply = Message(Error(code=ErrorCode.INVALID_FAB,
                                      reason=f"this silo {details}"), reply_to=message)
                return
            assert self.app is not None  # a warm runtime's (__init__)
            reply = self.app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
            logger.info("%s message answered in this process in %.2f s",
                        message.metadata.message_type, time.perf_counter() - started)
        except StaleTask as exc:  # nobody waits for its reply: none is sent
            logger.warning("dropped a task of run %d: %s", TaskIdentity.run_id, exc)
            details = f"stale task: {exc}"
        except Exception as exc:  # the same contract as Flower's: an Error reply, not a crash
            logger.exception("ClientApp raised an exception")
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                      reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            finally:
                push_task_output(client, context, status, details)
                heartbeat.stop()
                client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpcfl_flwr.flower_compat.warm_runtime",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True,
                        help="The SuperNode's Runtime API, host:port.")
    parser.add_argument("--parent-pid", type=int,
                        help="Exit when this process (the SuperNode) exits.")
    parser.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_SECONDS,
                        help="Seconds between looks for a task.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    if args.parent_pid is not None:
        start_parent_process_monitor(args.parent_pid)
    app = _installed_client_app()  # after the arguments parse: it imports torch

    with contextlib.suppress(KeyboardInterrupt):  # the parent monitor: the SuperNode is gone
        WarmRuntime(args.runtime_api_address, app, args.poll_seconds).serve()


def _installed_client_app() -> ClientApp:
    """The installed package's ClientApp, loaded by reference as Flower loads a FAB's (the
    pin, :mod:`..app_pin`, makes sure the FAB's reference names this same code)."""
    module, _, attribute = app_pin.CLIENTAPP.partition(":")
    app = getattr(importlib.import_module(module), attribute)
    if not isinstance(app, ClientApp):
        raise TypeError(f"{app_pin.CLIENTAPP} is not a ClientApp")
    return app


if __name__ == "__main__":
    main()
