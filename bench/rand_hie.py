"""Real tabular records with a natural split into silos: the six RAND Health Insurance
Experiment sites (examples/rand_hie.py: label, self-rated health excellent) as six silos with
their own CSV files, trained with R-DPCFL, DP-FedAvg (``global``) and local training, in
simulation, beside two reference lines that are no private method:

- ``majority``: each site answers its own training records' majority label (what a model
  that learnt nothing scores);
- ``LR pooled`` / ``LR per site``: a non-private logistic regression (scikit-learn, its
  default L2 penalty) on the same standardised features, trained on every site's training
  records at once, or on the site's own only.

Per method: test accuracy and balanced accuracy (the mean of the two labels' recalls: 50% for
any constant answer) of each site, of the group of sites 1-4, of the minority group (sites
5-6, fewer people in excellent health) and their mean over sites; for the private methods
also the largest epsilon spent, the clustering's ARI against the two groups and the wall time
per run, averaged over seeds (and their spread). The run results carry each silo's accuracy
only, so balanced accuracy is computed from the model each silo keeps of its final round
beside its ledger (docs/own-data.md, dpcfl_flwr/silo/kept_model.py) on that silo's test
records, read with the table source as the silo reads them; that the same predictions give
the run's accuracy is checked. The split is the exporter's (seed 0) in every run, so the
reference lines have no spread. The grid is ``dpcfl compare``'s, so an interrupted run resumes
where it stopped.

  python bench/rand_hie.py [--out results/rand-hie] [--seeds 0,1,2] [--epsilon 5]
                           [--rounds 40] [--methods rdpcfl,global,local] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish, script_module  # noqa: E402

_example = script_module(Path(__file__).resolve().parents[1] / "examples" / "rand_hie.py")
GROUPS, SITES, export = _example.GROUPS, _example.SITES, _example.export

#: The training schedule of every cell (the MLP on 15 standardised features), every value
#: stated so the figures do not move with the run config's defaults.
SCHEDULE = {"batch-size": 64, "learning-rate": 0.1, "clip-norm": 1.0, "local-epochs": 1,
            "eval-every": 10, "model-params.hidden": "64,64", "rdpcfl.n-clusters": 2}
REFERENCES = ("majority", "LR pooled", "LR per site")

#: Per site (in silo order): its test labels and the labels a method predicted for them.
Predictions = dict[int, tuple[np.ndarray, np.ndarray]]


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


def site_records(data_dir: Path, sites: list[int]) -> dict[int, Any]:
    """Each site's records (:class:`~dpcfl_flwr.data.partition.ClientData`) as its silo reads
    them: its CSV under the exported schema, the split from the file's ``split`` column."""
    from dpcfl_flwr.config.config_file import load_schema
    from dpcfl_flwr.data.sources import SourceRequest
    from dpcfl_flwr.data.table import load_table

    schema = load_schema(data_dir / "schema.toml")
    return {site: load_table(SourceRequest(data_dir / f"site-{site}.csv", partition, 0, 0.0,
                                           0.2, schema, {"split-column": "split"}))
            for partition, site in enumerate(sites)}


def reference_predictions(records: dict[int, Any]) -> dict[str, Predictions]:
    """The reference lines' test predictions: each site's training majority label, and a
    logistic regression trained on all sites' training records or on the site's own."""
    from sklearn.linear_model import LogisticRegression

    def fitted(sites: list[int]) -> LogisticRegression:
        x = np.concatenate([records[s].x_train.numpy() for s in sites])
        y = np.concatenate([records[s].y_train.numpy() for s in sites])
        return LogisticRegression(max_iter=1000).fit(x, y)

    pooled = fitted(list(records))
    found: dict[str, Predictions] = {name: {} for name in REFERENCES}
    for site, data in records.items():
        x, y = data.x_test.numpy(), data.y_test.numpy()
        majority = int(np.bincount(data.y_train.numpy()).argmax())
        found["majority"][site] = y, np.full_like(y, majority)
        found["LR pooled"][site] = y, pooled.predict(x)
        found["LR per site"][site] = y, fitted([site]).predict(x)
    return found


def kept_model_predictions(cell: Path, records: dict[int, Any],
                           results: dict[str, Any]) -> Predictions:
    """Each silo's test predictions by the final model it kept beside its ledger in this
    cell, checked against the accuracy the run reported for it."""
    from dpcfl_flwr.silo.kept_model import load_silo_model

    reported = {c["partition"]: c["test_accuracy"] for c in results["clients"]}
    found: Predictions = {}
    for partition, (site, data) in enumerate(records.items()):
        files = sorted((cell / "ledgers").glob(f"silo-{partition}.run-*.model.pt"))
        if len(files) != 1:
            raise SystemExit(f"{cell}: expected one model file of silo {partition}, "
                             f"found {len(files)}")
        model, metadata = load_silo_model(files[0])
        if not metadata["final"]:
            raise SystemExit(f"{files[0]}: not the run's final model (round "
                             f"{metadata['round']})")
        with torch.no_grad():
            predicted = model(data.x_test).argmax(dim=1).numpy()
        y = data.y_test.numpy()
        if not math.isclose(float((predicted == y).mean()), reported[partition],
                            abs_tol=1e-6):
            raise SystemExit(f"{files[0]}: its predictions do not give the run's accuracy "
                             f"{reported[partition]:.4f}")
        found[site] = y, predicted
    return found


def scores(predictions: Predictions) -> dict[str, float]:
    """Accuracy and balanced accuracy (percent) per site, per group and over sites."""
    figures: dict[str, float] = {}
    for kind in ("accuracy", "balanced accuracy"):
        per_site = {}
        for site, (y, predicted) in predictions.items():
            hits = predicted == y
            recalls = [hits[y == label].mean() for label in np.unique(y)]
            per_site[site] = 100 * float(hits.mean() if kind == "accuracy"
                                         else np.mean(recalls))
        figures |= {f"{kind}: site {site}": value for site, value in per_site.items()}
        for group in (0, 1):
            figures[f"{kind}: group {group}"] = statistics.mean(
                v for s, v in per_site.items() if GROUPS[s] == group)
        figures[f"{kind}: mean"] = statistics.mean(per_site.values())
    return figures


def run_figures(cell: Path, records: dict[int, Any]) -> dict[str, float]:
    """One private run's figures: its scores, epsilon, ARI, wall seconds."""
    results = json.loads((cell / "results.json").read_text())
    figures = scores(kept_model_predictions(cell, records, results))
    figures["max epsilon"] = results["summary"]["max_epsilon_spent"]
    figures["wall (s)"] = results["wall_seconds"]
    clustering = results.get("clustering", {})
    for key, label in (("ari", "round-1 ARI"), ("final_ari", "final ARI")):
        if clustering.get(key) is not None:
            figures[label] = clustering[key]
    return figures


def table(per_column: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table: one row per figure, one column per method (mean ± sd over runs)."""
    columns = list(per_column)
    keys = list(dict.fromkeys(k for runs in per_column.values() for run in runs for k in run))
    rows = []
    for key in keys:
        cells = []
        for column in columns:
            values = [run[key] for run in per_column[column] if key in run]
            spread = f" ± {statistics.stdev(values):.2g}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.3g}{spread}" if values else "-")
        rows.append(f"| {key} | {' | '.join(cells)} |")
    return (f"| figure | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}\n"
            + "\n".join(rows) + "\n")


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
    sites = [int(p.stem.removeprefix("site-")) for p in export(data_dir)]
    config = grid_config(data_dir, args.rounds)
    grid = args.out / "grid"
    subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--config", str(config),
                    "--methods", args.methods, "--epsilons", f"{args.epsilon:g}", "--seeds",
                    args.seeds, "--out", str(grid), "--cpus", "2"], check=True)
    records = site_records(data_dir, sites)
    per_column = {name: [scores(found)]
                  for name, found in reference_predictions(records).items()}
    for method in args.methods.split(","):
        per_column[method] = [run_figures(grid / method / f"eps{args.epsilon:g}" / f"seed{s}",
                                          records) for s in args.seeds.split(",")]
    body = (f"Six silos, one per RAND HIE site (examples/rand_hie.py: 15 standardised "
            f"features, label self-rated health excellent), the MLP, epsilon "
            f"{args.epsilon:g} per silo, {args.rounds} rounds, seeds {args.seeds} (mean ± sd); "
            f"schedule {json.dumps(SCHEDULE)}. Accuracies in %, on each site's own test "
            "persons; group 0 = sites 1-4, group 1 = sites 5-6. majority, LR pooled and LR "
            "per site are non-private reference lines (one fit on the fixed split); balanced "
            "accuracy of the private methods is from each silo's kept final model.\n\n"
            + table(per_column))
    publish("RAND HIE sites as silos", body, append=not args.no_append)


if __name__ == "__main__":
    main()
