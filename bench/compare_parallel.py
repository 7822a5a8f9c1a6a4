"""A small ``dpcfl compare`` grid one cell at a time against ``--parallel 2``, in one run.

Both grids are the same cells (methods x seeds at one epsilon, each a full simulation in its
own process) on the same machine, back to back: the wall time of each, their ratio, and the
machine's load average before and after (the machine is shared, so the ratio is the figure,
not the seconds). Each cell of the parallel grid has a local Ray of half the CPUs
(``dpcfl_flwr.runs.compare.cell_cpus``), so both grids train at most as many silos at once as
there are cores.

  python bench/compare_parallel.py [--methods global,local] [--seeds 0,1] [--no-append]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, finished_runs, publish  # noqa: E402

TITLE = "A comparison grid: one cell at a time or two at once"
#: Small cells: 6 silos of 200 records, 3 rounds; Python's and Ray's start-up are a large
#: share of such a cell, which is the part two cells at once overlap best.
SMALL = """clusters = "3,3"
samples-per-client = 200
num-server-rounds = 3
test-samples = 200
eval-every = 3
"""


def load() -> str:
    """The 1-minute load average and the cores it is shared by."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def grid(config: Path, out: Path, methods: str, seeds: str, parallel: int) -> float:
    """Wall seconds of one whole grid (a fresh ``dpcfl compare`` process)."""
    command = [sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--config", str(config),
               "--methods", methods, "--epsilons", "5", "--seeds", seeds, "--out", str(out)]
    if parallel > 1:
        command += ["--parallel", str(parallel)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the grid in {out} failed:\n{done.stdout[-3000:]}")
    return wall


def layout(out: Path) -> set[str]:
    return {re.sub(r"\d+", "N", str(p.relative_to(out))) for p in out.rglob("*") if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="global,local")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    cells = len(args.methods.split(",")) * len(args.seeds.split(","))
    with tempfile.TemporaryDirectory(prefix="compare-parallel-") as scratch:
        root = Path(scratch)
        config = root / "grid.toml"
        config.write_text(SMALL)
        before = load()
        walls = {k: grid(config, root / f"k{k}", args.methods, args.seeds, k) for k in (1, 2)}
        after = load()
        same = layout(root / "k1") == layout(root / "k2")
        done = {k: len(finished_runs(root / f"k{k}")) for k in walls}
    body = f"""{cells} cells ({args.methods} x seeds {args.seeds}, epsilon 5; each: 6 silos of
200 records, 3 rounds, a `dpcfl simulate` process of its own). Load average {before} before,
{after} after (a benchmark queue shares the machine).

| grid | wall (s) | finished cells |
|---|---|---|
| one at a time | {walls[1]:.0f} | {done[1]} of {cells} |
| `--parallel 2` | {walls[2]:.0f} | {done[2]} of {cells} |

`--parallel 2` took {walls[2] / walls[1]:.2f} x the sequential wall time; both grids wrote the
{"same" if same else "DIFFERENT"} files (paths with numbers masked).

On a loaded machine a grid of more processes also takes a larger share of the shared cores,
so part of a gain there may be CPU taken from other work rather than CPU one cell at a time
left idle (Python's and Ray's start, the server's rounds, evaluation)."""
    publish(TITLE, body, not args.no_append)


if __name__ == "__main__":
    main()
