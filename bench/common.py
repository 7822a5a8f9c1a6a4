"""Shared helpers of the benchmarks: timing, the machine, appending to bench/RESULTS.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
REPO = RESULTS.parents[1]


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """Best throughput over ``repeats`` runs of ``fn`` (which returns items per second): on a
    shared, noisy VM the best run is the least disturbed one."""
    return max(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=RESULTS.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_results(title: str, body: str) -> None:
    """Append a section with the exact command, date, commit and machine."""
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"\n## {title}\n\n`{command}` — {stamp}, commit {commit()}\n"
               f"({machine()})\n\n{body.strip()}\n")
    with RESULTS.open("a") as handle:
        handle.write(section)
    print(section)


def publish(title: str, body: str, append: bool) -> None:
    """Print the figures, and append them to RESULTS.md unless told not to (--no-append)."""
    if append:
        append_results(title, body)
    else:
        print(body)


def simulate_quick(out: Path, **overrides: object) -> tuple[float, dict]:
    """The quick example exactly as a user runs it (a fresh ``dpcfl simulate`` process, so the
    wall time includes Python and Ray start-up), with ``--set key=value`` overrides; returns
    the wall seconds and its results.json."""
    command = [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--config",
               str(REPO / "examples" / "quick.toml"), "--out", str(out), "--quiet",
               "--overwrite"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start, json.loads((out / "results.json").read_text())
