"""Shared helpers of the benchmarks: timing, the machine, recording a run's figures.

A recorded run goes to two places: its section is appended to the bench's history file
(``bench/history/<bench>.md``, every run kept, newest last), and it replaces the section of the
same title in ``bench/RESULTS.md``, which holds only the current figure of each benchmark.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

RESULTS = Path(__file__).with_name("RESULTS.md")
HISTORY = RESULTS.with_name("history")
REPO = RESULTS.parents[1]
CONTENTS_START = "<!-- contents -->"
CONTENTS_END = "<!-- /contents -->"


def script_module(path: Path) -> ModuleType:
    """The Python file ``path`` (a script, e.g. under examples/, which is no package) loaded
    as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def section(title: str, body: str) -> str:
    """A section with the exact command, date, commit and machine of this run."""
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"## {title}\n\n`{command}` — {stamp}, commit {commit()}\n"
            f"({machine()})\n\n{body.strip()}\n")


def _anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _with_contents(text: str) -> str:
    """``text`` with the list between the contents markers rebuilt from its headings: each
    question (``## ``) and, indented under it, the figures that answer it (``### ``)."""
    if CONTENTS_START not in text or CONTENTS_END not in text:
        return text
    head, rest = text.split(CONTENTS_START, 1)
    _, tail = rest.split(CONTENTS_END, 1)
    entries = ""
    for line in tail.splitlines():
        for level, indent in (("## ", ""), ("### ", "  ")):
            if line.startswith(level):
                title = line[len(level):].strip()
                entries += f"{indent}- [{title}](#{_anchor(title)})\n"
    return f"{head}{CONTENTS_START}\n{entries}{CONTENTS_END}{tail}"


def _heading_level(line: str) -> int:
    """2 for ``## ``, 3 for ``### `` (and so on), 0 for a line that is no heading."""
    hashes = len(line) - len(line.lstrip("#"))
    return hashes if hashes and line[hashes:hashes + 1] == " " else 0


def replace_section(text: str, title: str, new_section: str) -> str:
    """``text`` (a results file) with the section titled ``title`` replaced by
    ``new_section``: a figure (``### title``) under the question it answers, or a section of
    its own (``## title``), kept at the level it has, up to the next heading of the same or a
    higher level. A title found nowhere is added at the end as a section of its own (to be
    filed under its question by hand). Every other section is kept as it was, and the contents
    list is rebuilt."""
    lines = text.splitlines(keepends=True)
    body = new_section.rstrip("\n").split("\n", 1)
    rest = body[1] if len(body) > 1 else ""
    for index, line in enumerate(lines):
        level = _heading_level(line)
        if level >= 2 and line[level + 1:].rstrip() == title:
            end = next((j for j in range(index + 1, len(lines))
                        if 2 <= _heading_level(lines[j]) <= level), len(lines))
            replaced = f"{'#' * level} {title}\n{rest}\n"
            if end < len(lines):
                replaced += "\n"
            lines[index:end] = [replaced]
            return _with_contents("".join(lines))
    text = text.rstrip("\n") + "\n\n" if text.strip() else text
    return _with_contents(text + new_section.rstrip("\n") + "\n")


def append_results(title: str, body: str, *, results: Path = RESULTS,
                   history: Path = HISTORY, bench: str | None = None) -> None:
    """Record this run: append its section to ``history/<bench>.md`` and put it in place of
    the section of the same title in ``results`` (the current figures).

    ``bench`` names the history file; by default the running script's name (``overhead``).
    """
    text = section(title, body)
    name = bench or Path(sys.argv[0]).stem
    history.mkdir(parents=True, exist_ok=True)
    log = history / f"{name}.md"
    if not log.exists():
        log.write_text(f"# History of bench/{name}.py\n\nEvery recorded run, newest last; "
                       "the current figure is in bench/RESULTS.md.\n")
    with log.open("a") as handle:
        handle.write(f"\n{text}")
    current = results.read_text() if results.exists() else ""
    results.write_text(replace_section(current, title, text))
    print(text)


def publish(title: str, body: str, append: bool, *, results: Path = RESULTS,
            history: Path = HISTORY, bench: str | None = None) -> None:
    """Print the figures, and record them (history and current section, see
    :func:`append_results`) unless told not to (--no-append)."""
    if append:
        append_results(title, body, results=results, history=history, bench=bench)
    else:
        print(body)


def compare_grid(config: Path, methods: str, seeds: str, out: Path, settings: dict[str, Any],
                 rules: Sequence[str] | None = None, epsilons: str = "1") -> None:
    """One ``dpcfl compare`` grid (its finished cells are kept, so a study resumes where it
    stopped); ``settings`` are ``--set`` overrides, ``rules`` its aggregation axis. A grid that
    does not finish stops the study with a line saying how to continue."""
    command = [sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--config", str(config),
               "--methods", methods, "--epsilons", epsilons, "--seeds", seeds, "--out", str(out)]
    if rules:
        command += ["--aggregations", ",".join(rules)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    print("$", " ".join(command[1:]), flush=True)
    if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
        raise SystemExit(f"the grid in {out} did not finish; run this again to continue")


def finished_runs(folder: Path, cells: str = "*/eps*/seed*") -> list[dict[str, Any]]:
    """The results.json of every finished ``dpcfl compare`` cell below ``folder`` (``cells``:
    where they lie, by default ``<method>/eps*/seed*``), in path order; unfinished cells are
    left out."""
    found = []
    for path in sorted(folder.glob(f"{cells}/results.json")):
        results = json.loads(path.read_text())
        if results.get("complete"):
            found.append(results)
    return found


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
