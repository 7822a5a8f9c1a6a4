"""Robust-HDP's study at CPU scale on real Fashion-MNIST (docs/aggregation.md).

Four parts, each a ``dpcfl compare`` grid whose finished cells are kept, so the study can be
stopped at any time and continued by running this again:

1. **rules**: 20 i.i.d. silos (examples/robust-hdp-cpu.toml), each its own epsilon (presets
   Dist2 and Dist8 of paper 002) and batch size (the paper's list), one global model, every
   aggregation rule, 3 seeds: accuracy, the aggregated-noise level sum_i w_i^2 sigma_i^2 per
   coordinate (lr = 1, the paper's Table 3 quantity) and how Robust-HDP's weights correlate
   with the inverse-true-variance (oracle) weights;
2. **attack**: Dist2 with the three noisiest silos claiming 10x their epsilon, WeiAvg against
   Robust-HDP;
3. **learning-rate**: Dist8 at a 2.5x larger learning rate, DP-FedAvg against Robust-HDP
   (whose weights favour large-batch silos, which take fewer steps a round);
4. **clustered**: R-DPCFL on the rotation topology {3, 6, 6, 6} (the quick example) with
   heterogeneous budgets (5 x Dist2, the paper's batch sizes), per-cluster uniform against
   per-cluster Robust-HDP weights, and whether the clustering still finds the structure.

Every grid runs under the authors' accounting (split, classic, rdp), the default when the
study's figures were published, so they and its finished cells keep their meaning.

  nice python bench/robust_hdp.py [--parts rules,attack,learning-rate,clustered]
      [--seeds 0,1,2] [--no-append]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, compare_grid, finished_runs, publish  # noqa: E402
from dpcfl_flwr.config.paper_budgets import DISTRIBUTIONS  # noqa: E402
from dpcfl_flwr.privacy.defaults import AUTHORS_ACCOUNTING  # noqa: E402

OUT = REPO / "results" / "robust-hdp"
RULES = ("samples", "weiavg", "pfa", "min-eps", "robust-hdp", "oracle-variance")
DISTS = {"dist2": 0.005, "dist8": 0.002}  # preset -> learning rate (the paper's Table 9 scale)
ATTACK_RULES = ("weiavg", "robust-hdp")
CLUSTERED_RULES = ("uniform", "robust-hdp")
LEARNING_RATE_RULES = ("samples", "robust-hdp")
LARGER_LEARNING_RATE = 0.005  # Dist8 at Dist2's rate (paper 002 Table 9: Robust-HDP bears more)
LIARS = 3


def runs(out: Path, method: str, rule: str) -> list[dict[str, Any]]:
    """The finished results of one grid row, one per seed."""
    return finished_runs(out / f"{method}-{rule}", "eps*/seed*")


def local_steps(results: dict[str, Any]) -> dict[str, int]:
    """Per silo, the DP-SGD steps of one round: local epochs x ceil(N_i / b_i)."""
    epochs = int(results["config"].get("local-epochs", 1))
    return {str(c["partition"]): epochs * math.ceil(c["num_train"] / c["batch_size"])
            for c in results["clients"] if c["batch_size"]}


def true_variances(results: dict[str, Any], clip: float) -> dict[str, float]:
    """Per silo, the per-coordinate variance of one round's DP noise at lr = 1 (paper 002
    Eq. 7): K_i (z_i C / b_i)^2 with K_i the silo's steps in a round (:func:`local_steps`),
    from what the silos reported."""
    steps = local_steps(results)
    return {str(c["partition"]): steps[str(c["partition"])]
            * (c["noise_multiplier"] * clip / c["batch_size"]) ** 2
            for c in results["clients"] if c["noise_multiplier"] and c["batch_size"]}


def round_figures(results: dict[str, Any]) -> tuple[float, float, float, float]:
    """Mean over rounds 2..T and clusters of: the noise level, the noise level relative to
    the oracle's, the Pearson correlation of the weights with the oracle's, and the weighted
    local steps sum_i w_i K_i (how far, in steps at the shared learning rate, the aggregate
    moves: weights that favour large-batch silos favour silos that took few steps)."""
    variances = true_variances(results, float(results["config"]["clip-norm"]))
    steps = local_steps(results)
    levels, relative, correlation, moved = [], [], [], []
    for row in results["rounds"][1:]:
        for block in (row.get("aggregation") or {}).values():
            if block.get("noise_level") is None:
                continue
            levels.append(block["noise_level"])
            if block.get("oracle_noise_level"):
                relative.append(block["noise_level"] / block["oracle_noise_level"])
            partitions = sorted(block["weights"])
            if all(p in steps for p in partitions):
                moved.append(sum(block["weights"][p] * steps[p] for p in partitions))
            if len(partitions) > 2 and all(p in variances for p in partitions):
                weights = np.array([block["weights"][p] for p in partitions])
                inverse = 1.0 / np.array([variances[p] for p in partitions])
                if np.std(weights) > 0:
                    correlation.append(float(np.corrcoef(weights, inverse)[0, 1]))
    mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731
    return mean(levels), mean(relative), mean(correlation), mean(moved)


def pm(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    return f"{scale * np.mean(values):.{digits}f} ± {scale * np.std(values):.{digits}f}"


def sci(values: list[float]) -> str:
    values = [v for v in values if math.isfinite(v)]
    return f"{np.mean(values):.3g}" if values else "-"


def compute(results: list[dict[str, Any]]) -> str:
    """The wall time of a part's runs (each its own ``dpcfl simulate``, 2 cores)."""
    walls = [r["wall_seconds"] for r in results if r.get("wall_seconds")]
    if not walls:
        return ""
    return (f"\n{len(walls)} runs, {np.median(walls):.0f} s median wall per run, "
            f"{sum(walls) / 60:.0f} min in all.\n")


def accuracy(results: list[dict[str, Any]], key: str = "mean_accuracy") -> list[float]:
    return [r["summary"][key] for r in results if r["summary"].get(key) is not None]


def rules_part(seeds: str) -> str:
    config = REPO / "examples" / "robust-hdp-cpu.toml"
    for dist, lr in DISTS.items():
        compare_grid(config, "global", seeds, OUT / dist,
                     {"silo-epsilons": dist, "learning-rate": lr, **AUTHORS_ACCOUNTING},
                     rules=RULES)
    header = "| rule | " + " | ".join(DISTS) + " |\n|---|" + "---|" * len(DISTS)
    acc, noise, rel, corr, moved, every = [], [], [], [], [], []
    for rule in RULES:
        cells = {dist: runs(OUT / dist, "global", rule) for dist in DISTS}
        every += [r for d in DISTS for r in cells[d]]
        figures = {d: [round_figures(r) for r in cells[d]] for d in DISTS}
        acc.append(f"| {rule} | " + " | ".join(pm(accuracy(cells[d])) for d in DISTS) + " |")
        noise.append(f"| {rule} | " + " | ".join(sci([f[0] for f in figures[d]])
                                                 for d in DISTS) + " |")
        rel.append(f"| {rule} | " + " | ".join(pm([f[1] for f in figures[d]], 1.0, 2)
                                               for d in DISTS) + " |")
        corr.append(f"| {rule} | " + " | ".join(pm([f[2] for f in figures[d]], 1.0, 3)
                                                for d in DISTS) + " |")
        moved.append(f"| {rule} | " + " | ".join(pm([f[3] for f in figures[d]], 1.0, 1)
                                                 for d in DISTS) + " |")
    return ("20 i.i.d. silos, N_i = 1000, T = 10 rounds of one local epoch, each silo's epsilon "
            "from the preset (paper 002 Table 7) and its batch size from the paper's list; one "
            f"learning rate per preset ({', '.join(f'{d} {lr:g}' for d, lr in DISTS.items())}) "
            "for every rule. How these compare with the paper's Table 13: docs/aggregation.md"
            "#our-numbers-against-the-papers.\n\n"
            f"**Mean test accuracy (%)**, mean ± std over seeds {seeds}\n\n{header}\n"
            + "\n".join(acc) + "\n\n**Aggregated DP-noise level** sum_i w_i^2 sigma_i^2 per "
            "coordinate at lr = 1 (paper 002's Table 3 quantity), mean over rounds 2..T\n\n"
            f"{header}\n" + "\n".join(noise) + "\n\n**Noise level relative to the oracle's** "
            "(1 = inverse-true-variance weights)\n\n" f"{header}\n" + "\n".join(rel)
            + "\n\n**Correlation of the weights with the oracle's** (Pearson, per round)\n\n"
            f"{header}\n" + "\n".join(corr) + "\n\n**Weighted local steps** sum_i w_i K_i, "
            "K_i = ceil(N_i / b_i) DP-SGD steps of silo i in a round (b_i from 16 to 128: 63 "
            "to 8 steps): how far the aggregate moves at the shared learning rate\n\n"
            f"{header}\n" + "\n".join(moved) + "\n" + compute(every))


def noisiest(count: int) -> list[int]:
    """The ``count`` silos with the largest true noise in the honest Dist2 runs."""
    honest = runs(OUT / "dist2", "global", "samples")
    if not honest:
        raise SystemExit("the attack needs the rules part's Dist2 runs first")
    variances = true_variances(honest[0], float(honest[0]["config"]["clip-norm"]))
    return sorted(int(p) for p in sorted(variances, key=variances.get)[-count:])


def attack_part(seeds: str) -> str:
    liars = noisiest(LIARS)
    config = REPO / "examples" / "robust-hdp-cpu.toml"
    out = OUT / "attack-dist2"
    compare_grid(config, "global", seeds, out,
                 {"silo-epsilons": "dist2", "learning-rate": DISTS["dist2"],
                  "lying-silos": ",".join(map(str, liars)), "lie-factor": 10,
                  **AUTHORS_ACCOUNTING},
                 rules=ATTACK_RULES)
    lines = ["| rule | honest accuracy (%) | attacked accuracy (%) | honest noise level | "
             "attacked noise level |", "|---|---|---|---|---|"]
    every = []
    for rule in ATTACK_RULES:
        honest, attacked = runs(OUT / "dist2", "global", rule), runs(out, "global", rule)
        every += attacked
        lines.append(f"| {rule} | {pm(accuracy(honest))} | {pm(accuracy(attacked))} | "
                     f"{sci([round_figures(r)[0] for r in honest])} | "
                     f"{sci([round_figures(r)[0] for r in attacked])} |")
    return (f"Silos {liars} (the three noisiest under Dist2) claim 10x their epsilon; their "
            "noise stays calibrated for the real one. How to read it: docs/aggregation.md"
            "#our-numbers-against-the-papers.\n\n" + "\n".join(lines) + "\n"
            + compute(every))


def learning_rate_part(seeds: str) -> str:
    """Dist8 again at a 2.5x larger learning rate: does noise-aware weighting let the model
    take the larger steps that DP-FedAvg's noise forbids (paper 002 §4.2, Table 9)?"""
    base = DISTS["dist8"]
    out = OUT / f"dist8-lr{LARGER_LEARNING_RATE:g}"
    compare_grid(REPO / "examples" / "robust-hdp-cpu.toml", "global", seeds, out,
                 {"silo-epsilons": "dist8", "learning-rate": LARGER_LEARNING_RATE,
                  **AUTHORS_ACCOUNTING},
                 rules=LEARNING_RATE_RULES)
    lines = [f"| rule | accuracy at lr {base:g} (%) | accuracy at lr {LARGER_LEARNING_RATE:g} "
             "(%) | paired difference (points) |", "|---|---|---|---|"]
    every = []
    for rule in LEARNING_RATE_RULES:
        small = {r["config"]["seed"]: r for r in runs(OUT / "dist8", "global", rule)}
        large = {r["config"]["seed"]: r for r in runs(out, "global", rule)}
        every += list(large.values())
        paired = [large[s]["summary"]["mean_accuracy"] - small[s]["summary"]["mean_accuracy"]
                  for s in sorted(small.keys() & large.keys())]
        lines.append(f"| {rule} | {pm(accuracy(list(small.values())))} | "
                     f"{pm(accuracy(list(large.values())))} | {pm(paired)} |")
    return ("20 i.i.d. silos with Dist8's budgets (all epsilon <= 0.62), as in the rules part "
            f"but at learning rate {LARGER_LEARNING_RATE:g} as well as {base:g}.\n\n"
            + "\n".join(lines) + "\n" + compute(every))


def clustered_part(seeds: str) -> str:
    eps = ",".join(f"{5 * DISTRIBUTIONS['dist2'][i % 20]:g}" for i in range(21))
    out = OUT / "clustered"
    compare_grid(REPO / "examples" / "quick.toml", "rdpcfl", seeds, out,
                 {"silo-epsilons": eps, "silo-batch-sizes": "paper", "rpca-min-silos": 3,
                  **AUTHORS_ACCOUNTING},
                 rules=CLUSTERED_RULES)
    lines = ["| per-cluster rule | accuracy (%) | minority (%) | structure found | "
             "noise level |", "|---|---|---|---|---|"]
    every = []
    for rule in CLUSTERED_RULES:
        results = runs(out, "rdpcfl", rule)
        every += results
        found = sum(bool(r["clustering"].get("found_structure")) for r in results)
        lines.append(f"| {rule} | {pm(accuracy(results))} | "
                     f"{pm(accuracy(results, 'minority_accuracy'))} | {found}/{len(results)} | "
                     f"{sci([round_figures(r)[0] for r in results])} |")
    return ("R-DPCFL, the quick example's rotation topology {3, 6, 6, 6}, silo i's epsilon "
            "5 x Dist2[i mod 20] (1.0 .. 27), the paper's batch sizes, RPCA from 3 silos per "
            "cluster. Why the structure is lost when budgets differ this much: "
            "docs/aggregation.md#our-numbers-against-the-papers.\n\n" + "\n".join(lines)
            + "\n" + compute(every))


PARTS = {
    "rules": ("Robust-HDP: aggregation rules with heterogeneous budgets (20 i.i.d. silos, "
              "Fashion-MNIST)", rules_part),
    "attack": ("Robust-HDP: the falsified-budget attack", attack_part),
    "learning-rate": ("Robust-HDP: a larger learning rate under Dist8", learning_rate_part),
    "clustered": ("Robust-HDP inside R-DPCFL's clusters (heterogeneous budgets)",
                  clustered_part),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    for name in args.parts.split(","):
        title, part = PARTS[name]
        publish(title, part(args.seeds), not args.no_append, bench="robust_hdp")


if __name__ == "__main__":
    main()
