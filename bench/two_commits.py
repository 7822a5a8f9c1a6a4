"""Two commits back to back: did a change keep the quick example's figures?

For a restructuring that must change nothing a user sees, this runs the quick
example (``dpcfl simulate --config examples/quick.toml``, each commit's own file) for every
seed alternately on the two commits, so both see the same machine and the same load, and
compares wall time, accuracy, the epsilon each silo spent and the noise multiplier it
calibrated. With ``--overhead N`` it also runs ``bench/overhead.py`` (simulation and gRPC, 4
rounds) N times on each commit, alternately: one 4-round run can be 10 points off (a pair
once read 8% against 20%, and 8% / 7% when repeated). Each commit runs from a detached git
worktree of its own.

  python bench/two_commits.py BEFORE AFTER [--seeds 0,1,2] [--overhead N] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402

OVERHEAD = re.compile(r"^- (\w[\w-]*): mean overhead of rounds 2\.\.\d+ = (\d+)%", re.M)


def _run(tree: Path, command: list[str]) -> str:
    """``command`` with ``tree`` as the code (PYTHONPATH) and the working directory."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True,
                          text=True)
    return done.stdout


def quick(tree: Path, seed: int, out: Path) -> dict[str, Any]:
    """One quick-example run of ``tree``: wall seconds, accuracies, epsilons, z."""
    started = time.perf_counter()
    _run(tree, [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--config",
                str(tree / "examples" / "quick.toml"), "--out", str(out), "--quiet",
                "--overwrite", "--set", f"seed={seed}"])
    wall = time.perf_counter() - started
    results = json.loads((out / "results.json").read_text())
    clients = results["clients"]
    return {"wall": wall, "mean": results["summary"]["mean_accuracy"],
            "minority": results["summary"]["minority_accuracy"],
            "epsilon": sorted({round(c["epsilon_spent"], 9) for c in clients}),
            "z": sorted({round(c["noise_multiplier"], 9) for c in clients}),
            "found": results["clustering"].get("found_structure")}


def overhead(tree: Path) -> dict[str, int]:
    """Mean overhead (%) of rounds 2..4 per transport, from ``bench/overhead.py``."""
    printed = _run(tree, [sys.executable, "bench/overhead.py", "--transports",
                          "simulation,grpc", "--no-append"])
    return {name: int(value) for name, value in OVERHEAD.findall(printed)}


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--overhead", type=int, default=0, metavar="N")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    labels = {"before": args.before, "after": args.after}
    commits = {k: _run(REPO, ["git", "rev-parse", "--short", v]).strip()
               for k, v in labels.items()}
    rows, runs = [], {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {k: Path(tmp) / k for k in labels}
        for label, tree in trees.items():
            _run(REPO, ["git", "worktree", "add", "--detach", "-q", str(tree), labels[label]])
        try:
            for seed in (int(s) for s in args.seeds.split(",")):
                for label, tree in trees.items():
                    run = quick(tree, seed, Path(tmp) / f"{label}-{seed}")
                    runs[label].append(run)
                    rows.append(f"| {seed} | {label} ({commits[label]}) | {run['wall']:.1f} | "
                                f"{_percent(run['mean'])} | {_percent(run['minority'])} | "
                                f"{max(run['epsilon']):.6f} | {run['z'][0]:.6f} | "
                                f"{run['found']} |")
                    print(rows[-1], flush=True)
            loads: dict[str, list[dict[str, int]]] = {k: [] for k in trees}
            for _ in range(args.overhead):
                for label, tree in trees.items():
                    loads[label].append(overhead(tree))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                               check=False, capture_output=True)
    ratio = statistics.median(a["wall"] / b["wall"]
                              for a, b in zip(runs["after"], runs["before"], strict=True))
    same_privacy = all(a["epsilon"] == b["epsilon"] and a["z"] == b["z"]
                       for a, b in zip(runs["after"], runs["before"], strict=True))
    summary = [
        f"wall time after / before: median ratio {ratio:.3f} over {len(runs['after'])} pairs",
        *(f"{label}: mean accuracy {_percent(statistics.mean(r['mean'] for r in rs))}%, "
          f"minority {_percent(statistics.mean(r['minority'] for r in rs))}% over the seeds"
          for label, rs in runs.items()),
        "every silo's epsilon spent and noise multiplier identical: "
        f"{'yes' if same_privacy else 'NO'}",
        *(f"overhead of rounds 2..4, {transport}: before "
          f"{' / '.join(str(run[transport]) for run in loads['before'])}%, after "
          f"{' / '.join(str(run[transport]) for run in loads['after'])}%"
          for transport in (loads["after"][0] if loads["after"] else {})),
    ]
    body = ("| seed | commit | wall (s) | mean acc (%) | minority acc (%) | max eps spent | "
            "z | structure found |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
            + "\n\n" + "\n".join(f"- {line}" for line in summary))
    publish("Two commits back to back: the quick example", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
