"""`dpcfl compare --parallel`: cells at once, each its own process, killed and resumed, the
same layout as one cell at a time."""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcfl_flwr.runs.compare import GridRun, cell_cpus, plan_grid

TINY = """clusters = "2,2"
samples-per-client = 64
num-server-rounds = 2
test-samples = 40
eval-every = 2
"""
METHODS, SEEDS = ("global", "local"), (0, 1)


def _compare(config: Path, out: Path, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--methods", ",".join(METHODS),
         "--epsilons", "5", "--seeds", ",".join(map(str, SEEDS)), "--config", str(config),
         "--out", str(out), "--no-baselines", *options],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _layout(directory: Path) -> set[str]:
    """Every file's path under ``directory``, numbers (run ids, times, hosts' pids) as N."""
    return {re.sub(r"\d+", "N", str(path.relative_to(directory)))
            for path in directory.rglob("*") if path.is_file()}


def test_cells_share_the_cpus():
    assert cell_cpus(0, 1, None) == 0  # one at a time: a local Ray of the whole machine
    assert cell_cpus(4, 2, None) == 2 and cell_cpus(3, 2, None) == 1
    assert cell_cpus(2, 4, None) == 1  # never below one CPU (oversubscribed)
    assert cell_cpus(0, 2, None) == max(1, (os.cpu_count() or 1) // 2)
    assert cell_cpus(8, 2, "10.0.0.5:6379") == 0  # the cluster decides


@pytest.mark.slow
def test_a_parallel_grid_is_killed_resumed_and_laid_out_as_one_at_a_time(tmp_path):
    config, out = tmp_path / "grid.toml", tmp_path / "out"
    config.write_text(TINY)
    cells = plan_grid(list(METHODS), [5.0], list(SEEDS), out)
    process = _compare(config, out, "--parallel", "2")
    deadline = time.monotonic() + 900
    while not any(cell.results() for cell in cells):  # one finished while another runs
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        assert time.monotonic() < deadline
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)  # the grid and its cells, as a crash would
    process.wait()
    finished = {cell: (cell.directory / "results.json").stat().st_mtime
                for cell in cells if cell.results() is not None}
    assert 1 <= len(finished) < len(cells)

    resumed = _compare(config, out, "--parallel", "2")
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output
    for cell in cells:
        assert cell.results() is not None, output
        assert (f"{cell.label}: done earlier, kept" in output) == (cell in finished), output
    assert all((c.directory / "results.json").stat().st_mtime == t for c, t in finished.items())
    _one_line_per_event(output, [c for c in cells if c not in finished])
    with (out / "summary.csv").open() as handle:
        assert {row["method"] for row in csv.DictReader(handle)} == set(METHODS)

    # one at a time, the same cell writes the same files as it did beside another cell
    parallel_layout = _layout(out)
    again = cells[-1]
    shutil.rmtree(again.directory)
    sequential = _compare(config, out)
    output, _ = sequential.communicate(timeout=900)
    assert sequential.returncode == 0, output
    assert f"{again.label}: running ..." in output and "at once" not in output
    assert _layout(out) == parallel_layout
    twin = next(c for c in cells if c.method == again.method and c is not again)
    assert _layout(again.directory) == _layout(twin.directory)


def _one_line_per_event(output: str, ran: list[GridRun]) -> None:
    """Each cell that ran has its start and its end on a line of its own, whole, whatever the
    other cell printed meanwhile."""
    lines = output.splitlines()
    for cell in ran:
        assert sum(line.endswith(f"{cell.label}: running ...") for line in lines) == 1, output
        assert sum(bool(re.search(rf"{re.escape(cell.label)}: \d+ s, accuracy \d+\.\d%", line))
                   for line in lines) == 1, output
    assert "2 at once" in output, output


@pytest.mark.slow
def test_a_failed_cell_is_reported_and_the_others_kept(tmp_path):
    """R-DPCFL with M = 4 needs 5 silos, the grid has 4: its cell fails in its own process
    (one line in its log), while the cell beside it finishes and is tabulated."""
    config, out = tmp_path / "grid.toml", tmp_path / "out"
    config.write_text(TINY + "\n[rdpcfl]\nn-clusters = 4\n")
    done = subprocess.run(
        [sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--methods", "rdpcfl,global",
         "--epsilons", "5", "--seeds", "0", "--config", str(config), "--out", str(out),
         "--parallel", "2"], capture_output=True, text=True, timeout=900, check=False)
    failing, finishing = plan_grid(["rdpcfl", "global"], [5.0], [0], out)
    assert done.returncode != 0
    log = failing.directory.parent / "seed0.log"
    assert f"{failing.label} failed (exit 2); see {log}" in done.stdout, done.stdout
    assert "needs at least 5 silos" in log.read_text()
    assert failing.results() is None and finishing.results() is not None
    with (out / "summary.csv").open() as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    assert rows["global"]["seeds"] == "1" and float(rows["global"]["accuracy_mean"]) > 0
    assert rows.get("rdpcfl", {}).get("seeds", "0") == "0", rows
