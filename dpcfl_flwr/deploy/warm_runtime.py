"""A silo's ClientApp kept warm: one loaded ClientApp answers all of a run's messages.

Flower 1.39's SuperExec starts a fresh ``flwr-clientapp`` process for every message: a new
interpreter, torch and Flower imports, the FAB unpacked and the silo's data read again. On the
quick example that start-up was ~95% of a gRPC round (bench/RESULTS.md, "Framework overhead").
:class:`WarmRuntime` takes the SuperExec's place next to ``flower-supernode --isolation
process``: it acquires the SuperNode's tasks over the Runtime API and runs each one with
Flower's own task I/O (``flwr.supernode.runtime.run_clientapp``), so the imports, the loaded
ClientApp and the silo's cached data outlive a message. The Context (with the ledger record)
still arrives with every task, and the ledger on disk is written exactly as before. A silo
runs it inside its SuperNode's process (:mod:`.direct_runtime`, what ``dpcfl client`` starts);
``python -m dpcfl_flwr.deploy.warm_runtime`` runs it as a process of its own, over the
SuperNode's local HTTP API.

Serving a FAB's messages with modules imported here is only right when they are the FAB's own
code: a FAB is served warm only if its ``dpcfl_flwr`` sources are byte-identical to the ones
this process runs, and goes through Flower's cold path otherwise. Where the runtime can read
the FAB before taking the task (in the SuperNode's process, from its state: ``check_fab``), it
compares the FAB's files in memory, so a matching FAB is served warm from its first message;
otherwise the first task of every FAB takes the cold path (which installs the FAB) and the
installed files are compared after it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import FAB_HASH_TRUNCATION, ErrorCode, SubStatus
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
from flwr.supercore.utils import get_flwr_home
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

import dpcfl_flwr

from .silo_file import flower_tool

logger = logging.getLogger(__name__)

# Polling is the fallback when something wakes the runtime as soon as its SuperNode has stored
# a message (``wake``; in the SuperNode's process, its loop does). A separate process has no
# such signal and polls every second: an AcquireTask is ~1-3 ms on each side, and 21 silos at
# 10 Hz took about a third of this 2-core machine.
DEFAULT_POLL_SECONDS = 1.0
WOKEN_POLL_SECONDS = 10.0


def _sources(package: Path) -> dict[str, bytes]:
    return {str(path.relative_to(package)): path.read_bytes()
            for path in sorted(package.rglob("*.py"))}


# Read when this process starts, before the ClientApp's modules are imported: what it runs.
_PACKAGE = Path(dpcfl_flwr.__file__).parent
PACKAGE_NAME = _PACKAGE.name
_RUNNING_SOURCES = _sources(_PACKAGE)


def fab_ships_this_process(fab: bytes) -> bool:
    """Whether the FAB archive ``fab`` ships exactly the ClientApp code running here."""
    prefix = f"{PACKAGE_NAME}/"
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        shipped = {name[len(prefix):]: archive.read(name) for name in archive.namelist()
                   if name.startswith(prefix) and name.endswith(".py")}
    return shipped == _RUNNING_SOURCES


def fab_matches_this_process(fab_hash: str, flwr_home: Path | None = None) -> bool:
    """Whether the installed FAB ``fab_hash`` ships exactly the ClientApp code running here."""
    home = flwr_home or get_flwr_home()
    installed = sorted((home / "apps").glob(f"*.{fab_hash[:FAB_HASH_TRUNCATION]}"))
    if len(installed) != 1:
        return False
    shipped = installed[0] / PACKAGE_NAME
    return shipped.is_dir() and _sources(shipped) == _RUNNING_SOURCES


# token (None: the SuperExec's own, task-less calls) -> a Runtime API client for it (Flower's
# HTTP client, or one with its methods: direct_runtime.DirectRuntimeClient)
Connect = Callable[[str | None], RuntimeHttpClient]
# a task -> whether its FAB ships this process's code (None: cannot tell before taking it)
FabCheck = Callable[[Task], bool | None]


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
    """Acquire a SuperNode's ClientApp tasks and run them in this process (see module doc)."""

    def __init__(self, runtime_api_address: str, app: ClientApp,
                 poll_seconds: float = DEFAULT_POLL_SECONDS,
                 connect: Connect | None = None,
                 on_task_done: Callable[[], None] | None = None,
                 check_fab: FabCheck | None = None) -> None:
        self.address = runtime_api_address
        self.app = app
        self.poll_seconds = poll_seconds
        self.connect: Connect = connect or http_link(runtime_api_address)
        self.on_task_done = on_task_done  # e.g. wake the SuperNode to send the reply
        self.check_fab = check_fab
        self.warm_fabs: dict[str, bool] = {}  # fab hash -> served warm
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
        try:
            self._run(task, token)
        finally:
            if self.on_task_done is not None:
                self.on_task_done()

    def _run(self, task: Task, token: str) -> None:
        if task.fab_hash not in self.warm_fabs:
            verdict = self._check_ahead(task)
            if verdict is not None:
                self._judged(task.fab_hash, verdict)
        if self.warm_fabs.get(task.fab_hash):
            self._run_here(token)
            return
        self._run_cold(token)
        if task.fab_hash not in self.warm_fabs:
            self._judged(task.fab_hash, fab_matches_this_process(task.fab_hash))

    def _check_ahead(self, task: Task) -> bool | None:
        if self.check_fab is None:
            return None
        try:
            return self.check_fab(task)
        except Exception:  # noqa: BLE001 - Flower's cold path reports a bad FAB properly
            logger.exception("could not read FAB %s ahead of its task",
                             task.fab_hash[:FAB_HASH_TRUNCATION])
            return None

    def _judged(self, fab_hash: str, warm: bool) -> None:
        self.warm_fabs[fab_hash] = warm
        logger.info("FAB %s: %s", fab_hash[:FAB_HASH_TRUNCATION],
                    "served warm from now on" if warm else
                    "its code differs from this process's; one process per message")

    def _run_cold(self, token: str) -> None:
        """Flower's own path: a fresh ``flwr-clientapp`` for this one task."""
        command = flower_tool("flwr-clientapp") or "flwr-clientapp"
        subprocess.run([command, "--runtime-api-address", self.address, "--token", token,
                        "--insecure"], check=False)

    def _run_here(self, token: str) -> None:
        """``run_clientapp`` without the process around it: same pulls, pushes and statuses."""
        client = self.connect(token)
        heartbeat = HeartbeatSender(getattr(client, "task_heartbeat", None)
                                    or make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message: Message | None = None
        context: Context | None = None
        reply: Message | None = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        started = time.perf_counter()
        try:
            message, context, _run, _fab = pull_task_input(client)
            reply = self.app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
            logger.info("%s message answered in this process in %.2f s",
                        message.metadata.message_type, time.perf_counter() - started)
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
    parser = argparse.ArgumentParser(prog="python -m dpcfl_flwr.deploy.warm_runtime",
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
    from dpcfl_flwr.client_app import app  # noqa: PLC0415 (torch only once arguments parse)

    with contextlib.suppress(KeyboardInterrupt):  # the parent monitor: the SuperNode is gone
        WarmRuntime(args.runtime_api_address, app, args.poll_seconds).serve()


if __name__ == "__main__":
    main()
