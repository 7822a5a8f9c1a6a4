"""One paper-scale run, resumed across interruptions until it is done.

R-DPCFL on real Fashion-MNIST at the paper's scale (``examples/fmnist-paper.toml``: 21 silos
{3, 6, 6, 6}, rotation, N_i = 8000, E = 200, b = 32, lr = 0.005, c = 3) at eps = 10, the cell
of [003] Table 5 whose R-DPCFL figures are 80.26% mean / 79.03% minority accuracy. Hours on 2
CPU cores, so it is made to be killed: every call starts the run, or (a checkpoint exists)
resumes it with ``dpcfl simulate --resume``; ``<out>/bench-attempts.json`` counts the calls.
Once the run is complete the figures go to bench/RESULTS.md.

  nice -n 19 python bench/paper_scale.py [--out results/paper-fmnist-eps10] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402

CONFIG = REPO / "examples" / "fmnist-paper.toml"
EPSILON = 10.0
PAPER = (80.26, 79.03)  # [003] Table 5, RC-DPFL at eps = 10: mean / minority accuracy (%)


def attempt(out: Path) -> int:
    """Start or resume the run once; returns ``dpcfl simulate``'s exit status."""
    if (out / "checkpoint.pkl").exists():
        command = ["--resume", str(out)]
    else:
        command = ["--config", str(CONFIG), "--set", f"epsilon={EPSILON}", "--out", str(out),
                   "--overwrite"]
    return subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--quiet",
                           *command], cwd=REPO, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=REPO / "results" / "paper-fmnist-eps10")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    attempts_file = out / "bench-attempts.json"
    attempts = json.loads(attempts_file.read_text()) if attempts_file.exists() else []
    results_file = out / "results.json"
    done = results_file.exists() and json.loads(results_file.read_text()).get("complete")
    if not done:
        attempts.append({"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        attempts_file.write_text(json.dumps(attempts, indent=1))
        status = attempt(out)
        attempts[-1]["status"] = status
        attempts_file.write_text(json.dumps(attempts, indent=1))
        if status != 0:
            raise SystemExit(f"the run stopped (status {status}); run this again to resume")
    results = json.loads(results_file.read_text())
    summary = results["summary"]
    mean, minority = 100 * summary["mean_accuracy"], 100 * summary["minority_accuracy"]
    clustering = results["clustering"]
    body = (
        "| | mean accuracy (%) | minority accuracy (%) |\n|---|---|---|\n"
        f"| this run | {mean:.2f} | {minority:.2f} |\n"
        f"| paper ([003] Table 5, RC-DPFL, eps = 10) | {PAPER[0]} | {PAPER[1]} |\n\n"
        f"- wall time of the run: {results['wall_seconds'] / 3600:.1f} h (while running; "
        f"{len(attempts)} sessions, so {len(attempts) - 1} resumes)\n"
        f"- clustering: M = {clustering.get('n_clusters')}, MSS = {clustering.get('mss', 0):.2f}, "
        f"ARI = {clustering.get('ari', float('nan')):.2f}, structure found: "
        f"{clustering.get('found_structure')}, E_c = {clustering.get('switch_round')}\n"
        f"- max epsilon spent: {summary['max_epsilon_spent']:.4f} of {EPSILON:g}\n"
        f"- results directory: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    publish("Paper scale: R-DPCFL on Fashion-MNIST (N_i = 8000, E = 200, eps = 10)", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
