"""What every deployment command shares: its console lines, a plan table, one-line stops, and
children that end with the command (signals passed on, killed after a grace period, dead with
their supervisor)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable

import typer
from rich.console import Console
from rich.table import Table

console = Console()
errors = Console(stderr=True, soft_wrap=True)

#: How long a silo's SuperNode or a submit's `flwr run` may take to end after Ctrl-C before it
#: is killed (an idle SuperNode ends in 1-2 s; one in the middle of a task would finish it).
STOP_GRACE_SECONDS = 5.0
#: Set by the first SIGINT/SIGTERM this process receives while it runs a child.
signalled = threading.Event()


def stop(problems: list[str]) -> None:
    """Print each problem as one error line and exit with status 2."""
    for problem in problems:
        errors.print(f"[bold red]error:[/] {problem}", highlight=False)
    raise typer.Exit(code=2)


def stop_if(problems: list[str]) -> None:
    """:func:`stop` when there is any problem."""
    if problems:
        stop(problems)


def print_plan(title: str, rows: dict[str, str]) -> None:
    """What a command is about to start, as a two-column table."""
    table = Table(title=title, show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    console.print(table)


def forward_signals(process: subprocess.Popen, group: bool = False,
                     grace: float | None = None) -> Callable[[], bool]:
    """Pass SIGINT/SIGTERM on to ``process`` (its whole group with ``group``); the returned
    function says whether one arrived. With ``grace``, a process still running ``grace`` s
    after the first signal, or at a second one, is killed (SIGKILL): Ctrl-C must end a
    command within seconds even when its child is busy (a silo in the middle of a task)."""
    received: list[int] = []

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, signum)
            elif process.poll() is None:
                process.send_signal(signum)

    def kill_if_running() -> None:
        if process.poll() is None:
            send(signal.SIGKILL)

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        signalled.set()
        if grace is None:
            send(signum)
        elif len(received) > 1:
            kill_if_running()
        else:
            send(signum)
            timer = threading.Timer(grace, kill_if_running)
            timer.daemon = True
            timer.start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    return lambda: bool(received)


def wait_passing_output(process: subprocess.Popen, pump: Callable[[], None]) -> tuple[int, bool]:
    """Run ``pump`` (it passes the child's output on) while ``process`` runs in a group of its
    own, with signals forwarded (:func:`forward_signals`, :data:`STOP_GRACE_SECONDS`); kill
    what it leaves in its group. (exit code, stopped by SIGINT / SIGTERM)."""
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = forward_signals(process, group=True, grace=STOP_GRACE_SECONDS)
    code = process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # anything it left in its group
    reader.join(timeout=5)
    return code, stopped()


def die_with_parent() -> None:
    """Linux: SIGTERM this child when the supervisor dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


__all__ = ["STOP_GRACE_SECONDS", "console", "die_with_parent", "errors", "forward_signals",
           "print_plan", "signalled", "stop", "stop_if", "wait_passing_output"]
