"""A run submitted to a SuperLink: its id and the ServerApp's error line, read from what
``flwr run --stream`` prints, and its final status, asked with ``flwr ls --format json``.

Flower 1.39's ``flwr run --stream`` exits 0 however the run ends (the stream just stops), so
``dpcfl submit`` asks the SuperLink how the run finished before it picks its own exit status.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: What `flwr run` prints once the SuperLink has accepted the run.
_STARTED = re.compile(r"Successfully started run (\d+)")
#: The one line the ServerApp (server_app.py) logs for the error that ends a run, before
#: Flower's traceback; its per-module loggers (``dpcfl_flwr.strategies...``) log other things.
_APP_ERROR = re.compile(r"^ERROR dpcfl_flwr: (.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: How Flower 1.39 words the status details of a ServerApp that raised.
_RAISED = "ServerApp failed with exception: "


@dataclass
class StreamWatch:
    """Reads a ``flwr run --stream`` output line by line for the run id and the ServerApp's
    own error line (the last one, should there be several)."""

    run_id: int | None = None
    app_error: str | None = None

    def see(self, line: str) -> None:
        text = _ANSI.sub("", line).strip()
        if self.run_id is None and (started := _STARTED.search(text)):
            self.run_id = int(started.group(1))
        elif error := _APP_ERROR.match(text):
            self.app_error = error.group(1).strip()


@dataclass(frozen=True)
class RunStatus:
    """A run's status as ``flwr ls`` reports it (``running``, ``finished:completed``,
    ``finished:failed``, ``finished:stopped``) and Flower's details of it."""

    status: str
    details: str = ""

    @property
    def finished(self) -> bool:
        return self.status.startswith("finished")

    def failure(self, app_error: str | None = None) -> str | None:
        """Why a finished run did not complete, in one line (the ServerApp's own error line
        when there is one); None when it completed or is not finished."""
        if not self.finished or self.status == "finished:completed":
            return None
        if self.status == "finished:stopped":
            return "the run was stopped on the SuperLink (`flwr stop`)"
        if app_error:
            return app_error
        details = self.details.removeprefix(_RAISED).strip()
        return details or f"the run ended {self.status.removeprefix('finished:')}"


def run_status(flwr: str, connection: str, run_id: int, env: Mapping[str, str],
               timeout: float = 60) -> RunStatus | None:
    """Ask the SuperLink of ``connection`` for run ``run_id``'s status; None when it cannot
    be asked (unreachable, or an answer that is not Flower's JSON)."""
    try:
        answer = subprocess.run([flwr, "ls", connection, "--run-id", str(run_id), "--format",
                                 "json"], capture_output=True, text=True, env=dict(env),
                                timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        runs = json.loads(answer.stdout)["runs"]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return None
    for run in runs:
        if str(run.get("run-id")) == str(run_id):
            return RunStatus(str(run.get("status", "")), str(run.get("status-details") or ""))
    return None


def final_status(flwr: str, connection: str, run_id: int, env: Mapping[str, str],
                 wait: float = 20.0) -> RunStatus | None:
    """The run's status once it is finished; the last status seen when it is not within
    ``wait`` s (the log stream ends with the run, so this is normally the first answer)."""
    deadline = time.monotonic() + wait
    while True:
        status = run_status(flwr, connection, run_id, env)
        if (status is not None and status.finished) or time.monotonic() >= deadline:
            return status
        time.sleep(1.0)


def follow_hint(run_id: int | None, connection: str, flwr_home: Path) -> str:
    """How to list, follow and stop the run from a shell, with this connection."""
    prefix = ("" if flwr_home == Path.home() / ".flwr"
              else f"FLWR_HOME={flwr_home} ")
    run = "RUN-ID" if run_id is None else str(run_id)
    return (f"`{prefix}flwr log {run} {connection}` follows it, `{prefix}flwr stop {run} "
            f"{connection}` stops it, `{prefix}flwr ls {connection}` lists the runs")
