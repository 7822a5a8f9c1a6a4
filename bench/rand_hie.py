"""Real tabular records with a natural split into silos: the six RAND Health Insurance
Experiment sites (examples/rand_hie.py) as six silos with their own CSV files, trained with
R-DPCFL, DP-FedAvg (``global``) and local training, in simulation.

Per method: mean test accuracy over the silos, over the group of sites 1-4 and over the
minority group (sites 5-6, whose people had less medical spending), each site's own, the
largest epsilon spent, the final clustering's ARI against the two groups, and the wall time
per run; averaged over seeds (and their spread). The grid is ``dpcfl compare``'s, so an
interrupted run resumes where it stopped.

  python bench/rand_hie.py [--out results/rand-hie] [--seeds 0,1,2] [--epsilon 5]
                           [--rounds 40] [--methods rdpcfl,global,local] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish, script_module  # noqa: E402

_example = script_module(Path(__file__).resolve().parents[1] / "examples" / "rand_hie.py")
GROUPS, SITES, export = _example.GROUPS, _example.SITES, _example.export

#: The training schedule of every cell (the MLP on 18 standardised features).
SCHEDULE = {"batch-size": 64, "learning-rate": 0.1, "clip-norm": 1.0, "local-epochs": 1,
            "eval-every": 10, "rdpcfl.n-clusters": 2}


def grid_config(data_dir: Path, rounds: int) -> Path:
    """The grid's config: the exported run config plus the schedule."""
    lines = [(data_dir / "run.toml").read_text(), f"num-server-rounds = {rounds}\n"]
    tables: dict[str, list[str]] = {}
    for key, value in SCHEDULE.items():
        table, _, inner = key.rpartition(".")
        text = f"{inner} = {json.dumps(value)}\n"
        if table:
            tables.setdefault(table, []).append(text)
        else:
            lines.append(text)
    lines += [f"[{table}]\n{''.join(keys)}" for table, keys in tables.items()]
    path = data_dir / "grid.toml"
    path.write_text("".join(lines))
    return path


def cell_figures(results: dict) -> dict[str, float]:
    """One run's figures: accuracies (percent) overall, per group and per site, epsilon,
    ARI, wall seconds."""
    clients = sorted(results["clients"], key=lambda c: c["partition"])
    sites = sorted(SITES, key=lambda s: (GROUPS[s], s))
    accuracy = {site: 100 * c["test_accuracy"] for site, c in zip(sites, clients, strict=True)}
    figures = {f"site {site}": value for site, value in accuracy.items()}
    for group in (0, 1):
        members = [a for s, a in accuracy.items() if GROUPS[s] == group]
        figures[f"group {group}"] = statistics.mean(members)
    figures["mean"] = statistics.mean(accuracy.values())
    figures["max epsilon"] = results["summary"]["max_epsilon_spent"]
    figures["wall (s)"] = results["wall_seconds"]
    clustering = results.get("clustering", {})
    for key, label in (("ari", "round-1 ARI"), ("final_ari", "final ARI")):
        if clustering.get(key) is not None:
            figures[label] = clustering[key]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/rand-hie"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epsilon", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--methods", default="rdpcfl,global,local")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    data_dir = args.out / "data"
    export(data_dir)
    config = grid_config(data_dir, args.rounds)
    grid = args.out / "grid"
    subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--config", str(config),
                    "--methods", args.methods, "--epsilons", f"{args.epsilon:g}", "--seeds",
                    args.seeds, "--out", str(grid), "--cpus", "2"], check=True)
    methods = args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    per_method = {m: [cell_figures(json.loads((grid / m / f"eps{args.epsilon:g}" / f"seed{s}"
                                               / "results.json").read_text())) for s in seeds]
                  for m in methods}
    keys = list(dict.fromkeys(k for runs in per_method.values() for run in runs for k in run))
    rows = []
    for key in keys:
        cells = []
        for method in methods:
            values = [run[key] for run in per_method[method] if key in run]
            if not values:
                cells.append("-")
                continue
            spread = f" ± {statistics.stdev(values):.2g}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.3g}{spread}")
        rows.append(f"| {key} | {' | '.join(cells)} |")
    body = (f"Six silos, one per RAND HIE site (examples/rand_hie.py: 18 standardised features, "
            f"label any medical spending that year), the MLP, epsilon {args.epsilon:g} per "
            f"silo, {args.rounds} rounds, seeds {args.seeds} (mean ± sd). Accuracies in %, "
            "on each site's own test persons; group 0 = sites 1-4, group 1 = sites 5-6.\n\n"
            f"| figure | {' | '.join(methods)} |\n|---|{'---|' * len(methods)}\n"
            + "\n".join(rows) + "\n")
    publish("RAND HIE sites as silos", body, append=not args.no_append)


if __name__ == "__main__":
    main()
