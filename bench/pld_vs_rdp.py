"""What PLD accounting buys on real Fashion-MNIST (docs/privacy.md#pld-accounting).

R-DPCFL with ``accountant = rdp`` against ``accountant = pld`` on the same silos and seeds: the
quick example (eps = 10) and the CPU-scale comparison cell at eps = 3
(examples/fmnist-cpu-1000.toml). PLD's tighter bound lets every silo calibrate a smaller z for
the same budget; the table gives z, the epsilon the silos' ledgers spent, and the accuracy
(overall and minority), mean ± std over seeds. Each setting is a ``dpcfl compare`` grid whose
finished cells are kept: stop it any time and run it again to continue.

  nice python bench/pld_vs_rdp.py [--seeds 0,1,2] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, compare_grid, finished_runs, publish  # noqa: E402

OUT = REPO / "results" / "pld-vs-rdp"
SETTINGS = {  # name -> (config, epsilon)
    "quick example": (REPO / "examples" / "quick.toml", 10.0),
    "CPU-scale cell (N_i = 1000)": (REPO / "examples" / "fmnist-cpu-1000.toml", 3.0),
}


def grid(config: Path, epsilon: float, accountant: str, seeds: str, out: Path) -> list[dict]:
    """One resumable R-DPCFL grid under ``accountant`` and its finished runs, in the authors'
    split as published (docs/privacy.md#pld-accounting)."""
    compare_grid(config, "rdpcfl", seeds, out,
                 {"accountant": accountant, "budget-mode": "split", "conversion": "classic"},
                 epsilons=f"{epsilon:g}")
    return finished_runs(out, f"rdpcfl/eps{epsilon:g}/seed*")


def pm(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    return (f"{scale * np.mean(values):.{digits}f} ± {scale * np.std(values):.{digits}f}"
            if values else "-")


def figures(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per run (in seed order): the median silo's z, the largest spend, accuracy, minority
    accuracy and wall seconds."""
    return {
        "z": [float(np.median([c["noise_multiplier"] for c in r["clients"]
                               if c["noise_multiplier"]])) for r in runs],
        "spent": [max(c["epsilon_spent"] for c in r["clients"]) for r in runs],
        "accuracy": [r["summary"]["mean_accuracy"] for r in runs],
        "minority": [r["summary"]["minority_accuracy"] for r in runs
                     if r["summary"].get("minority_accuracy") is not None],
        "wall": [r["wall_seconds"] for r in runs if r.get("wall_seconds")],
    }


def row(name: str, epsilon: float, accountant: str, f: dict[str, list[float]]) -> str:
    return (f"| {name} | {epsilon:g} | {accountant} | {np.mean(f['z']):.4f} | "
            f"{np.max(f['spent']):.3f} | {pm(f['accuracy'])} | {pm(f['minority'])} | "
            f"{np.median(f['wall']) if f['wall'] else float('nan'):.0f} | {len(f['z'])} |")


def difference(name: str, rdp: dict[str, list[float]], pld: dict[str, list[float]]) -> str:
    """PLD against RDP on the same seeds: z and wall as ratios, accuracy as paired
    differences in points."""
    paired = lambda key: pm([b - a for a, b in zip(rdp[key], pld[key], strict=True)])  # noqa: E731
    return (f"- {name}: z x {np.mean(pld['z']) / np.mean(rdp['z']):.3f}; accuracy "
            f"{paired('accuracy')} points, minority {paired('minority')} points (pld - rdp, "
            f"same seed); wall x {np.median(pld['wall']) / np.median(rdp['wall']):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    lines = ["| setting | eps | accountant | z (median silo) | largest eps spent (own "
             "accountant) | accuracy (%) | minority (%) | wall per run (s, median) | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    differences = []
    for index, (name, (config, epsilon)) in enumerate(SETTINGS.items()):
        found = {}
        for accountant in ("rdp", "pld"):
            found[accountant] = figures(grid(config, epsilon, accountant, args.seeds,
                                             OUT / f"setting{index}-{accountant}"))
            lines.append(row(name, epsilon, accountant, found[accountant]))
        differences.append(difference(name, found["rdp"], found["pld"]))
    body = ("R-DPCFL, each silo calibrating z for its whole two-stage schedule with its own "
            "accountant (its spend measured by the same one). PLD's epsilon of a history is "
            "never above RDP's (docs/privacy.md#pld-accounting), so for the same budget z is "
            "smaller and the models less noisy. Wall times are of runs made one after the other on "
            "the same machine.\n\n" + "\n".join(lines) + "\n\n" + "\n".join(differences)
            + "\n")
    publish("PLD against RDP accounting: z, spend and accuracy on Fashion-MNIST", body,
            not args.no_append, bench="pld_vs_rdp")


if __name__ == "__main__":
    main()
