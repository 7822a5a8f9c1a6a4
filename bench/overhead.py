"""Framework overhead of a round: client compute against everything else.

A round's wall time (measured by the server from sending to the last reply) is compared with
the CPU time the silos spent inside their train handler (``cpu-seconds`` in every reply).
With W workers running silos in parallel, the round cannot be shorter than sum(CPU) / W; the
rest is the framework: (de)serialisation, scheduling, polling, process start-up, server work.
overhead = 1 - sum(CPU) / (W * round wall). CPU time, not wall time: 21 silo processes sharing
2 cores each wait for the others inside their handler.

In simulation each of the W Ray workers runs one silo at a time to the end, so no scheduler
can finish a round sooner than the best split of its silos' CPU times over W workers
(:func:`packing_bound`; 21 equal silos on 2 workers: 11 back to back). The "packing floor" and
"beyond packing" columns compare the round with that floor instead of sum(CPU) / W. With the
silo times measured here (a +-15% spread) the floor is within 0.1 s of sum(CPU) / W, so idle
workers at a round's end are the engine's dispatch order, not arithmetic.

Two transports, the quick example's R-DPCFL rounds (21 silos, N_i = 500):
  simulation  Flower's simulation engine, 2 Ray workers (W = 2)
  grpc        one flower-superlink and 21 flower-supernode processes on 127.0.0.1 with TLS and
              node authentication, each silo's messages answered by its warm ClientApp in
              the SuperNode's process (W = 2 cores)
  grpc-per-message  the same, with Flower's fresh ClientApp process for every message

With --by-process, every process's CPU time is sampled from /proc (bench/process_cpu.py) and
rounds 2..R's capacity (W cores x wall) is split into the silos' work, each role's other CPU
and idle time: where the overhead goes. With --repeat K, each transport runs K times and a
round's figures are the K runs' medians, with the range of its overhead: one run's round
moves by several points from run to run on a shared machine.

  python bench/overhead.py [--rounds 4] [--transports simulation,grpc,grpc-per-message]
                           [--idle-poll S] [--pull-hold S] [--cpus-per-client C]
                           [--by-process] [--repeat K] [--no-append]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402
from bench.process_cpu import ProcessCpuSampler  # noqa: E402
from dpcfl_flwr.config.config_file import load_config, toml_value  # noqa: E402
from dpcfl_flwr.config.settings import parse_run_config  # noqa: E402
from dpcfl_flwr.deploy.localhost import LocalDeployment, silo_flags  # noqa: E402
from dpcfl_flwr.runs.simulation import run_simulation  # noqa: E402

WORKERS = 2
DEFAULT_ROUNDS = 4
DEFAULT_TRANSPORTS = "simulation,grpc"


def quick(rounds: int, out: Path, scale: dict[str, int]) -> dict:
    """The quick example's run config, shortened to ``rounds``; ``scale`` may set its N_i."""
    base = load_config(REPO / "examples" / "quick.toml", {})
    return {**base.to_run_config(), "num-server-rounds": rounds, "eval-every": rounds,
            "out-dir": str(out), **scale}


def simulation(rounds: int, root: Path, scale: dict[str, int],
               cpus_per_client: float = 1.0) -> dict:
    out = root / "simulation"
    run_simulation(parse_run_config({**quick(rounds, out, scale), "silo-cpus": cpus_per_client}),
                   cpus=WORKERS)
    return json.loads((out / "results.json").read_text())


def grpc(rounds: int, root: Path, scale: dict[str, int], *silo_options: str,
         server_options: tuple[str, ...] = ()) -> dict:
    deployment = LocalDeployment(root / "grpc", clusters="3,6,6,6")
    try:
        # in memory: 21 silos on 2 cores overrun SQLite's busy timeout
        deployment.up("--in-memory", *server_options)
        opt_in_cpu_seconds(deployment.root / "clients")
        config = quick(rounds, deployment.root / "run", scale)
        for i in range(deployment.silos):
            deployment.silo(i, *silo_flags(config), *silo_options)
        values = {k: toml_value(v) for k, v in config.items()
                  if k not in ("clusters", "out-dir")}
        values["round-timeout"] = toml_value(600.0)  # a lost reply fails in minutes
        run = deployment.flwr_run("run", REPO, **values)
        try:
            code = deployment.wait_run(run, timeout=7200)
        except RuntimeError as exc:
            run.kill()
            raise SystemExit(f"{exc}; so the gRPC overhead cannot be measured") from exc
        results = deployment.root / "run" / "results.json"
        if code != 0 or not results.exists():
            raise SystemExit(f"flwr run failed (exit {code}), so the gRPC overhead cannot be "
                             f"measured: {deployment.last_line('run')}")
        return json.loads(results.read_text())
    finally:
        deployment.down()


def opt_in_cpu_seconds(silo_files: Path) -> None:
    """Let every deployed silo report its train handler's CPU seconds, which the overhead is
    measured against: a deployed silo leaves them out unless its operator opts in (they
    follow the Poisson sample). The key goes at the end of each file, in its ``[node]``
    table (the last one ``dpcfl topology silos`` writes)."""
    files = sorted(silo_files.glob("silo-*.toml"))
    if not files:
        raise SystemExit(f"no silo files in {silo_files}")
    for path in files:
        text = path.read_text()
        if text.rfind("[node]") < text.rfind("\n["):
            raise SystemExit(f"{path}: [node] is not its last table; cannot opt in")
        path.write_text(text.rstrip("\n") + "\nreport-cpu-seconds = true\n")


def packing_bound(times: list[float], workers: int) -> float:
    """The shortest possible makespan of these jobs on ``workers`` workers that each run one
    job at a time to the end: at least sum / workers, and, for every k, among the k*W + 1
    longest jobs some worker runs k + 1, so at least the k + 1 shortest of those in sequence."""
    longest = sorted(times, reverse=True)
    bound = sum(longest) / workers
    for k in range(len(longest) // workers + 1):
        top = longest[:k * workers + 1]
        if len(top) == k * workers + 1:
            bound = max(bound, sum(top[-(k + 1):]))
    return bound


def whole(results: dict) -> float:
    """The overhead of all rounds together (round 1 included), weighted by their walls."""
    rounds = results["rounds"]
    return 1 - (sum(r["client_cpu_seconds"] for r in rounds)
                / (WORKERS * sum(r["seconds"] for r in rounds)))


def round_figures(name: str, results: dict, sequential_workers: bool) -> list[dict]:
    """Per round of one run: its wall, the silos' CPU, the packing floor (sum / W when silos
    time-share the cores, as over gRPC), the overhead and the overhead beyond the floor."""
    silent = [r["round"] for r in results["rounds"] if not r["client_cpu_seconds"]]
    if silent:
        raise SystemExit(f"{name}: no silo reported cpu-seconds in rounds {silent}, so the "
                         "overhead cannot be measured")
    figures = []
    for r in results["rounds"]:
        compute, wall = r["client_cpu_seconds"], r["seconds"]
        floor = compute / WORKERS
        if sequential_workers and r.get("silo_cpu_seconds"):
            floor = packing_bound(list(r["silo_cpu_seconds"].values()), WORKERS)
        figures.append({"round": r["round"], "stage": r["stage"], "wall": wall,
                        "compute": compute, "floor": floor,
                        "overhead": 1 - compute / (WORKERS * wall),
                        "beyond": 1 - floor / wall})
    return figures


def rows(name: str, runs: list[list[dict]]) -> tuple[list[str], float, float]:
    """Table rows, each round's median over ``runs`` (the runs' range of its overhead when
    there are several), the mean of rounds 2..R's median overhead, and the same beyond the
    packing floor."""
    lines, fractions, beyond = [], [], []
    for rounds in zip(*runs, strict=True):
        m = {key: float(np.median([r[key] for r in rounds]))
             for key in ("wall", "compute", "floor", "overhead", "beyond")}
        first = rounds[0]
        if first["round"] > 1:
            fractions.append(m["overhead"])
            beyond.append(m["beyond"])
        spread = ""
        if len(runs) > 1:
            values = [100 * r["overhead"] for r in rounds]
            spread = f" {min(values):.0f}-{max(values):.0f}% |"
        lines.append(f"| {name} | {first['round']} ({first['stage']}) | {m['wall']:.1f} | "
                     f"{m['compute']:.1f} | {m['compute'] / WORKERS:.1f} | {m['floor']:.1f} | "
                     f"{100 * m['overhead']:.0f}% | {100 * m['beyond']:.0f}% |{spread}")
    return lines, float(np.mean(fractions)), float(np.mean(beyond))


def split_by_process(name: str, results: dict, sampler: ProcessCpuSampler) -> str:
    """Rounds 2..R's capacity (cores x wall) by where it went: silo work (inside the train
    handler), every role's other CPU, and idle cores."""
    later = [r for r in results["rounds"] if r["round"] > 1]
    capacity = sum(WORKERS * r["seconds"] for r in later)
    work = sum(r["client_cpu_seconds"] for r in later)
    by_role: dict[str, float] = {}
    for r in later:
        for role, seconds in sampler.cpu_between(*sampler.round_window(r["round"])).items():
            by_role[role] = by_role.get(role, 0.0) + seconds
    # whose processes ran the handler: Ray's workers, separate ClientApp runtimes, or the
    # SuperNodes themselves (a ClientApp answered in the SuperNode's process)
    silo_role = ("Ray workers" if name == "simulation" else "ClientApp runtimes"
                 if by_role.get("ClientApp runtimes", 0.0) >= work else "SuperNodes")
    by_role[silo_role] = by_role.get(silo_role, 0.0) - work  # the rest of the silos' CPU
    lines = [f"| silo work (train handler) | {work:.1f} | {100 * work / capacity:.0f}% |"]
    for role, seconds in sorted(by_role.items(), key=lambda item: -item[1]):
        label = f"{role}, outside the handler" if role == silo_role else role
        lines.append(f"| {label} | {seconds:.1f} | {100 * seconds / capacity:.0f}% |")
    idle = capacity - work - sum(by_role.values())
    lines.append(f"| idle cores | {idle:.1f} | {100 * idle / capacity:.0f}% |")
    return (f"{name}, rounds 2..{later[-1]['round']}: {capacity:.1f} core-seconds "
            f"({WORKERS} cores x {capacity / WORKERS:.1f} s) by process role\n\n"
            "| where | CPU (s) | share |\n|---|---|---|\n" + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--transports", default=DEFAULT_TRANSPORTS)
    parser.add_argument("--samples-per-client", type=int,
                        help="N_i (default: the quick example's 500; the paper's is 8000)")
    parser.add_argument("--cpus-per-client", type=float, default=1.0,
                        help="Ray CPUs per silo in simulation (2/3: three workers on 2 cores)")
    parser.add_argument("--idle-poll", type=float,
                        help="gRPC silos' SuperLink poll when idle (default: the silo file's)")
    parser.add_argument("--pull-hold", type=float,
                        help="how long the SuperLink may hold an idle silo's poll (default: "
                             "`dpcfl server`'s; 0: Flower's immediate answer)")
    parser.add_argument("--by-process", action="store_true",
                        help="also split each transport's rounds 2..R by process role")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per transport; each round's figures are their medians")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    scale = {"samples-per-client": args.samples_per_client} if args.samples_per_client else {}
    poll = ("--idle-poll", f"{args.idle_poll:g}") if args.idle_poll else ()
    hold = ("--pull-hold", f"{args.pull_hold:g}") if args.pull_hold is not None else ()
    table, summary, splits = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.transports.split(","):
            run = {"simulation": lambda r, d, s: simulation(r, d, s, args.cpus_per_client),
                   "grpc": lambda r, d, s: grpc(r, d, s, *poll, server_options=hold),
                   "grpc-per-message": lambda r, d, s: grpc(r, d, s, "--process-per-message",
                                                            *poll, server_options=hold)}[name]
            sequential = name == "simulation" and args.cpus_per_client == 1.0
            runs, walls, totals = [], [], []
            for attempt in range(args.repeat):
                started = time.perf_counter()
                root = Path(tmp) / f"{name}-{attempt}"
                progress = root / ("simulation" if name == "simulation" else "grpc/run") / (
                    "progress.jsonl")
                # Sample /proc only when asked (the first run): sampling is CPU the measured
                # round does not get.
                sampler = ProcessCpuSampler(progress)
                sampled = args.by_process and attempt == 0
                with sampler if sampled else contextlib.nullcontext():
                    results = run(args.rounds, root, scale)
                walls.append(time.perf_counter() - started)
                runs.append(round_figures(name, results, sequential))
                totals.append(whole(results))
                if sampled:
                    splits.append(split_by_process(name, results, sampler))
                print(f"{name}: run {attempt + 1} of {args.repeat} done", file=sys.stderr)
            lines, mean, beyond = rows(name, runs)
            table += lines
            medians = "" if args.repeat == 1 else f"of {args.repeat} runs' medians "
            summary.append(f"{name}: mean overhead {medians}of rounds 2..{args.rounds} = "
                           f"{100 * mean:.0f}% ({100 * beyond:.0f}% beyond packing); "
                           f"rounds 1..{args.rounds} together {100 * np.median(totals):.0f}%; "
                           f"whole run {np.median(walls):.0f} s wall")
    spread = ("", "") if args.repeat == 1 else (" overhead, range over runs |", "---|")
    body = ("| transport | round | round wall (s) | client CPU, sum (s) | "
            f"CPU / {WORKERS} cores (s) | packing floor (s) | overhead | beyond packing |"
            f"{spread[0]}\n|---|---|---|---|---|---|---|---|{spread[1]}\n"
            + "\n".join(table) + "\n\n" + "\n".join(f"- {s}" for s in summary)
            + "".join(f"\n\n{split}" for split in splits))
    publish(_title(args), body, append=not args.no_append)


def _title(args: argparse.Namespace) -> str:
    """The section title: the scale, and the transports and rounds where they are not the
    standard run's, so each kind of run keeps its own current section in RESULTS.md."""
    parts = [f"N_i = {args.samples_per_client}" if args.samples_per_client else "quick example",
             "21 silos"]
    if args.transports != DEFAULT_TRANSPORTS:
        parts.append(f"transports {args.transports}")
    if args.rounds != DEFAULT_ROUNDS:
        parts.append(f"{args.rounds} rounds")
    if args.repeat > 1:
        parts.append(f"medians of {args.repeat} runs")
    return f"Framework overhead per round ({', '.join(parts)})"


if __name__ == "__main__":
    main()
