"""Framework overhead of a round: client compute against everything else.

A round's wall time (measured by the server from sending to the last reply) is compared with
the CPU time the silos spent inside their train handler (``cpu-seconds`` in every reply).
With W workers running silos in parallel, the round cannot be shorter than sum(CPU) / W; the
rest is the framework: (de)serialisation, scheduling, polling, process start-up, server work.
overhead = 1 - sum(CPU) / (W * round wall). CPU time, not wall time: 21 silo processes sharing
2 cores each wait for the others inside their handler.

Two transports, the quick example's R-DPCFL rounds (21 silos, N_i = 500):
  simulation  Flower's simulation engine, 2 Ray workers (W = 2)
  grpc        one flower-superlink and 21 flower-supernode processes on 127.0.0.1 with TLS and
              node authentication, each silo's messages answered by its warm ClientApp
              runtime (W = 2 cores)
  grpc-per-message  the same, with Flower's fresh ClientApp process for every message

  python bench/overhead.py [--rounds 4] [--transports simulation,grpc,grpc-per-message]
                           [--no-append]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402
from dpcfl_flwr.config import parse_run_config  # noqa: E402
from dpcfl_flwr.deploy.localhost import LocalDeployment  # noqa: E402
from dpcfl_flwr.simulation import load_config, run_simulation  # noqa: E402

WORKERS = 2


def quick(rounds: int, out: Path, scale: dict[str, int]) -> dict:
    """The quick example's run config, shortened to ``rounds``; ``scale`` may set its N_i."""
    base = load_config(REPO / "examples" / "quick.toml", {})
    return {**base.to_run_config(), "num-server-rounds": rounds, "eval-every": rounds,
            "out-dir": str(out), **scale}


def simulation(rounds: int, root: Path, scale: dict[str, int]) -> dict:
    out = root / "simulation"
    run_simulation(parse_run_config(quick(rounds, out, scale)), cpus=WORKERS)
    return json.loads((out / "results.json").read_text())


def grpc(rounds: int, root: Path, scale: dict[str, int], *silo_options: str) -> dict:
    deployment = LocalDeployment(root / "grpc", clusters="3,6,6,6")
    try:
        deployment.up("--in-memory")  # 21 silos on 2 cores overrun SQLite's busy timeout
        for i in range(deployment.silos):
            deployment.silo(i, *silo_options)
        config = quick(rounds, deployment.root / "run", scale)
        values = {k: (f'"{v}"' if isinstance(v, str) else repr(v)) for k, v in config.items()
                  if k not in ("clusters", "out-dir")}
        values["round-timeout"] = 600.0  # a lost reply fails the bench in minutes, not an hour
        run = deployment.flwr_run("run", REPO, **values)
        run.wait(timeout=7200)
        return json.loads((deployment.root / "run" / "results.json").read_text())
    finally:
        deployment.down()


def rows(name: str, results: dict) -> tuple[list[str], float]:
    lines, fractions = [], []
    for r in results["rounds"]:
        compute, wall = r["client_cpu_seconds"], r["seconds"]
        fraction = 1 - compute / (WORKERS * wall)
        if r["round"] > 1:
            fractions.append(fraction)
        lines.append(f"| {name} | {r['round']} ({r['stage']}) | {wall:.1f} | {compute:.1f} | "
                     f"{compute / WORKERS:.1f} | {100 * fraction:.0f}% |")
    return lines, float(np.mean(fractions))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--transports", default="simulation,grpc")
    parser.add_argument("--samples-per-client", type=int,
                        help="N_i (default: the quick example's 500; the paper's is 8000)")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    scale = {"samples-per-client": args.samples_per_client} if args.samples_per_client else {}
    table, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.transports.split(","):
            started = time.perf_counter()
            run = {"simulation": simulation, "grpc": grpc,
                   "grpc-per-message": lambda r, d, s: grpc(r, d, s, "--process-per-message")}[name]
            results = run(args.rounds, Path(tmp) / name, scale)
            wall = time.perf_counter() - started
            lines, mean = rows(name, results)
            table += lines
            summary.append(f"{name}: mean overhead of rounds 2..{args.rounds} = "
                           f"{100 * mean:.0f}%; whole run {wall:.0f} s wall")
    body = ("| transport | round | round wall (s) | client CPU, sum (s) | "
            f"CPU / {WORKERS} cores (s) | overhead |\n|---|---|---|---|---|---|\n"
            + "\n".join(table) + "\n\n" + "\n".join(f"- {s}" for s in summary))
    scale = f"N_i = {args.samples_per_client}" if args.samples_per_client else "quick example"
    publish(f"Framework overhead per round ({scale}, 21 silos)", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
