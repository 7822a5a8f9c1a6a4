"""The local process table as a deployment and its benchmarks need it (Linux: /proc), and
the exit status of a launcher that runs one of Flower's commands in its own process."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def parent_and_cpu(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of a live process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := parent_and_cpu(int(entry))) is not None:
            table[int(entry)] = stat
    return table


def descendants(root: int) -> set[int]:
    """Every live process below ``root``: children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _cpu) in process_table().items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    pending = list(children.get(root, []))
    while pending:
        pid = pending.pop()
        found.add(pid)
        pending.extend(children.get(pid, []))
    return found


def exit_code_of(run: Callable[[], object]) -> int:
    """Run ``run`` to its end and say how the process should exit: the code a ``SystemExit``
    carries (Flower exits that way, also on signals), 1 after printing any other error."""
    try:
        run()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported here, the process ends right after
        traceback.print_exc()
        return 1
    return 0
