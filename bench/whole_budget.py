"""The whole budget put to work: the old default accounting against the new, on real runs.

R-DPCFL on Fashion-MNIST under the authors' accounting (the old default: ``budget-mode =
split``, ``conversion = classic``, ``accountant = rdp``) and under the default since
(``joint``, ``tight``, ``pld``: everything composed and converted once,
docs/privacy.md#the-default-accounting), on the same silos and seeds: the quick example at
eps = 10 and the CPU-scale comparison cell (examples/fmnist-cpu-1000.toml, bench/RESULTS.md
"The paper's comparison on real Fashion-MNIST at a CPU scale") at eps = 3 and 5. Per setting
and accounting: the median silo's z, the smallest and largest final spend of a silo (its own
ledger, its own accountant), accuracy overall and on the minority, mean ± std over seeds; then
the new against the old on the same seed. Both accountings are named in full (``--set``), so
a later change of default re-runs nothing. Each setting and accounting is a ``dpcfl compare``
grid whose finished cells are kept: stop any time and run the same command to continue.

Cost: 3 settings x 2 accountings x 3 seeds = 18 simulations, about 2 minutes each on 2 idle
cores (bench/RESULTS.md; PLD's runs 1-4% longer), so about 40 minutes.

  nice python bench/whole_budget.py [--seeds 0,1,2] [--settings quick,cpu3,cpu5] [--no-append]
      [--set key=value ...] [--out DIR]

``--set`` changes a run-config key in every run (a smoke run: ``--set num-server-rounds=6
--out results/whole-budget-smoke --no-append``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, compare_grid, finished_runs, publish  # noqa: E402
from dpcfl_flwr.privacy.defaults import (  # noqa: E402
    AUTHORS_ACCOUNTING,
    DEFAULT_ACCOUNTANT,
    DEFAULT_BUDGET_MODE,
    DEFAULT_CONVERSION,
)

OUT = REPO / "results" / "whole-budget"
TITLE = "The whole budget: the old default accounting against the new"
SETTINGS = {  # key -> (name, config, epsilon)
    "quick": ("quick example", REPO / "examples" / "quick.toml", 10.0),
    "cpu3": ("CPU-scale cell (N_i = 1000)", REPO / "examples" / "fmnist-cpu-1000.toml", 3.0),
    "cpu5": ("CPU-scale cell (N_i = 1000)", REPO / "examples" / "fmnist-cpu-1000.toml", 5.0),
}
ACCOUNTINGS = {
    "old (split, classic, rdp)": AUTHORS_ACCOUNTING,
    "new (joint, tight, pld)": {"budget-mode": DEFAULT_BUDGET_MODE,
                                "conversion": DEFAULT_CONVERSION,
                                "accountant": DEFAULT_ACCOUNTANT},
}


def figures(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per run, in seed order: the median silo's z, the smallest and largest spend, accuracy
    and minority accuracy."""
    spends = [[c["epsilon_spent"] for c in r["clients"]] for r in runs]
    return {
        "z": [float(np.median([c["noise_multiplier"] for c in r["clients"]
                               if c["noise_multiplier"]])) for r in runs],
        "least": [min(s) for s in spends], "most": [max(s) for s in spends],
        "accuracy": [r["summary"]["mean_accuracy"] for r in runs],
        "minority": [r["summary"]["minority_accuracy"] for r in runs
                     if r["summary"].get("minority_accuracy") is not None],
    }


def pm(values: list[float], scale: float = 100.0) -> str:
    return f"{scale * np.mean(values):.1f} ± {scale * np.std(values):.1f}" if values else "-"


def row(name: str, epsilon: float, accounting: str, f: dict[str, list[float]]) -> str:
    return (f"| {name} | {epsilon:g} | {accounting} | {np.mean(f['z']):.4f} | "
            f"{np.min(f['least']):.3f} - {np.max(f['most']):.3f} | {pm(f['accuracy'])} | "
            f"{pm(f['minority'])} | {len(f['z'])} |")


def difference(name: str, epsilon: float, old: dict[str, list[float]],
               new: dict[str, list[float]]) -> str:
    """The new against the old on the same seeds: z as a ratio, accuracy in points."""
    def paired(key: str) -> str:
        return pm([b - a for a, b in zip(old[key], new[key], strict=True)])
    return (f"- {name}, eps = {epsilon:g}: z x {np.mean(new['z']) / np.mean(old['z']):.3f}; "
            f"accuracy {paired('accuracy')} points, minority {paired('minority')} points "
            "(new - old, same seed)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"some of {', '.join(SETTINGS)}")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config key for every run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    extra = dict(pair.split("=", 1) for pair in args.set)
    lines = ["| setting | eps | accounting | z (median silo) | final spend, least - most "
             "silo | accuracy (%) | minority (%) | seeds |", "|---|---|---|---|---|---|---|---|"]
    differences = []
    for key in args.settings.split(","):
        if key not in SETTINGS:
            raise SystemExit(f"unknown setting {key!r}; choose from {', '.join(SETTINGS)}")
        name, config, epsilon = SETTINGS[key]
        found = []
        for index, (label, accounting) in enumerate(ACCOUNTINGS.items()):
            out = args.out.resolve() / f"{key}-{index}"
            compare_grid(config, "rdpcfl", args.seeds, out, {**extra, **accounting},
                         epsilons=f"{epsilon:g}")
            found.append(figures(finished_runs(out, f"rdpcfl/eps{epsilon:g}/seed*")))
            lines.append(row(name, epsilon, label, found[-1]))
        differences.append(difference(name, epsilon, *found))
    body = ("R-DPCFL, every silo calibrating z for its whole two-stage schedule (its T_sel "
            "selections at 3% of eps) under the accounting named, and measuring its spend with "
            "the same accountant. The old default converts the selections alone and gives "
            "training the rest, so its silos end below their budget; the new composes "
            "everything and converts once, so they end within 1% of it "
            "(docs/privacy.md#the-default-accounting).\n\n" + "\n".join(lines) + "\n\n"
            + "\n".join(differences) + "\n")
    publish(TITLE, body, not args.no_append, bench="whole_budget")


if __name__ == "__main__":
    main()
