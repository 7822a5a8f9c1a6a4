"""The tables and figure of a ``dpcfl compare`` grid (summary.md, summary.csv, comparison.png):
per row (a method, or a method and aggregation rule) and epsilon, mean ± std over seeds of
accuracy, balanced accuracy, AUROC (two classes), minority accuracy, clustering and the silos'
privacy figures. The baselines the grid adds (``local``, ``majority``) are rows like any other.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .compare import AXIS_KEY, GridRun, discovers_clusters, variant


@dataclass
class Cell:
    """One row (a method, or a method with a rule on an aggregation axis) and epsilon over its
    seeds."""

    method: str
    epsilon: float
    accuracy: list[float]
    minority: list[float]
    found_structure: int | None
    minority_isolated: int | None
    seeds: int
    # Per seed: the largest noise multiplier of a silo, and the largest epsilon a silo spent.
    noise: list[float] = dataclasses.field(default_factory=list)
    spent: list[float] = dataclasses.field(default_factory=list)
    rule: str | None = None  # the grid's rule (None: no aggregation axis)
    aggregation: str = ""  # the rule the runs used, from their configs ("": not recorded)
    # Per seed that recorded its aggregations: the mean aggregated noise level, and its mean
    # ratio to the oracle's (see mean_noise_level, mean_oracle_ratio).
    noise_level: list[float] = dataclasses.field(default_factory=list)
    oracle_ratio: list[float] = dataclasses.field(default_factory=list)
    # Per seed: mean balanced accuracy and (two classes) mean AUROC over the silos
    balanced: list[float] = dataclasses.field(default_factory=list)
    auroc: list[float] = dataclasses.field(default_factory=list)

    @property
    def variant(self) -> str:
        return variant(self.method, self.rule)


def collect(runs: Iterable[GridRun]) -> list[Cell]:
    groups: dict[tuple[str, str | None, float], list[dict[str, Any]]] = {}
    for run in runs:
        finished = run.results()
        if finished is not None:
            groups.setdefault((run.method, run.rule, run.epsilon), []).append(finished)
    return [_cell(method, rule, epsilon, results)
            for (method, rule, epsilon), results in groups.items()]


def _cell(method: str, rule: str | None, epsilon: float, results: list[dict[str, Any]]
          ) -> Cell:
    summaries = [r["summary"] for r in results]
    clustered = discovers_clusters(method)
    used = {str(r["config"].get(AXIS_KEY, "")) for r in results}
    return Cell(  # a run without a minority (or unknown figures) adds none
        method, epsilon, _known(s.get("mean_accuracy") for s in summaries),
        _known(s.get("minority_accuracy") for s in summaries),
        sum(bool(r["clustering"].get("found_structure")) for r in results)
        if clustered else None,
        sum(bool(r["clustering"].get("minority_isolated")) for r in results)
        if clustered else None,
        len(results),
        [max((c["noise_multiplier"] for c in r["clients"]
              if c.get("noise_multiplier") is not None), default=0.0) for r in results],
        [s.get("max_epsilon_spent") or 0.0 for s in summaries],
        rule, rule or ",".join(sorted(used)),
        _known(mean_noise_level(r) for r in results),
        _known(mean_oracle_ratio(r) for r in results),
        _known(s.get("mean_balanced_accuracy") for s in summaries),
        _known(s.get("mean_auroc") for s in summaries))


def aggregation_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every per-round, per-cluster aggregation record of a run (none in results written before
    the rounds recorded them)."""
    return [block for row in results.get("rounds", [])
            for block in (row.get("aggregation") or {}).values() if block]


def mean_noise_level(results: dict[str, Any]) -> float | None:
    """The aggregated noise level sum_i w_i^2 sigma_i^2 (per coordinate, at learning rate 1),
    averaged over the run's rounds and clusters; None when the run recorded none."""
    levels = [b["noise_level"] for b in aggregation_records(results)
              if _finite(b.get("noise_level"))]
    return float(np.mean(levels)) if levels else None


def mean_oracle_ratio(results: dict[str, Any]) -> float | None:
    """noise level / the oracle's (inverse-true-variance weights on the same silos), averaged
    over the run's rounds and clusters: >= 1, 1 when the rule weighs as well as the oracle."""
    ratios = [b["noise_level"] / b["oracle_noise_level"] for b in aggregation_records(results)
              if _finite(b.get("noise_level")) and _finite(b.get("oracle_noise_level"))
              and b["oracle_noise_level"] > 0]
    return float(np.mean(ratios)) if ratios else None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _mean_std(values: list[float]) -> tuple[float | str, float | str]:
    return (float(np.mean(values)), float(np.std(values))) if values else ("", "")


def _pm(values: list[float], form: str = "percent") -> str:
    """mean ± std: of percentages, in scientific notation ("sci"), of plain ratios (two
    decimals) or of fractions such as AUROC (three)."""
    if not values:
        return "-"
    mean, std = float(np.mean(values)), float(np.std(values))
    if form == "sci":
        return f"{mean:.2e} ± {std:.1e}"
    if form == "ratio":
        return f"{mean:.2f} ± {std:.2f}"
    if form == "fraction":
        return f"{mean:.3f} ± {std:.3f}"
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def markdown(cells: list[Cell], rows: Sequence[str], epsilons: Sequence[float]) -> str:
    """The paper's form: accuracy (all / minority clients) per row and eps, detections and
    privacy; the aggregated noise level when the runs recorded it. ``rows``: :func:`variants`."""
    by = {(c.variant, c.epsilon): c for c in cells}
    first = "method/aggregation" if any("/" in row for row in rows) else "method"
    header = f"| {first} | " + " | ".join(f"eps={e:g}" for e in epsilons) + " |"
    rule = "|---|" + "---|" * len(epsilons)

    def grid(title: str, show: Callable[[Cell], str], only: Sequence[str] = rows) -> str:
        lines = [f"| {row} | " + " | ".join(show(by[(row, e)]) if (row, e) in by else "-"
                                            for e in epsilons) + " |" for row in only]
        return f"{title}\n\n{header}\n{rule}\n" + "\n".join(lines)

    parts = [grid("**Mean test accuracy over all clients (%)** (mean ± std over seeds)",
                  lambda c: _pm(c.accuracy)),
             grid("**Mean balanced accuracy over all clients (%)** (the mean recall of the "
                  "classes in each client's test split; mean ± std over seeds)",
                  lambda c: _pm(c.balanced))]
    if any(c.auroc for c in cells):
        parts.append(grid("**Mean AUROC over all clients** (two classes; 0.5 is chance; mean ± "
                          "std over seeds)", lambda c: _pm(c.auroc, "fraction")))
    parts.append(grid("**Mean test accuracy over the minority clients (%)** (mean ± std over "
                      "seeds)", lambda c: _pm(c.minority)))
    detecting = [row for row in rows if discovers_clusters(row.partition("/")[0])]
    if detecting:
        parts.append(grid("**Seeds that found the full cluster structure · that isolated the "
                          "minority cluster**",
                          lambda c: f"{c.found_structure}/{c.seeds} · "
                                    f"{c.minority_isolated}/{c.seeds}", detecting))
    parts.append(grid("**Privacy: the silos' noise multiplier z · the largest epsilon a silo "
                      "spent** (largest over seeds, from the silos' own ledgers)",
                      lambda c: f"{max(c.noise):.3g} · {max(c.spent):.2f}" if c.spent else "-"))
    if any(c.noise_level for c in cells):
        parts.append(grid("**Aggregated noise level Σ w_i² σ_i² per coordinate** (at learning "
                          "rate 1; mean over rounds and clusters, mean ± std over seeds)",
                          lambda c: _pm(c.noise_level, "sci")))
    if any(c.oracle_ratio for c in cells):
        parts.append(grid("**Noise level relative to the oracle's** (the inverse-true-variance "
                          "weights; 1 is optimal, mean ± std over seeds)",
                          lambda c: _pm(c.oracle_ratio, "ratio")))
    return "\n\n".join(parts) + "\n"


CSV_COLUMNS = ("method", "epsilon", "seeds", "accuracy_mean", "accuracy_std", "minority_mean",
               "minority_std", "found_structure", "minority_isolated", "max_noise_multiplier",
               "max_epsilon_spent", "aggregation", "noise_level_mean", "noise_level_std",
               "noise_vs_oracle_mean", "noise_vs_oracle_std", "balanced_accuracy_mean",
               "balanced_accuracy_std", "auroc_mean", "auroc_std")


def write_reports(cells: list[Cell], rows: Sequence[str], epsilons: Sequence[float],
                  out: Path) -> str:
    table = markdown(cells, rows, epsilons)
    (out / "summary.md").write_text(table)
    with (out / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for c in sorted(cells, key=lambda c: (c.method, c.rule or "", c.epsilon)):
            writer.writerow([c.method, c.epsilon, c.seeds, *_mean_std(c.accuracy),
                             *_mean_std(c.minority),
                             "" if c.found_structure is None else c.found_structure,
                             "" if c.minority_isolated is None else c.minority_isolated,
                             max(c.noise, default=""), max(c.spent, default=""),
                             c.aggregation, *_mean_std(c.noise_level),
                             *_mean_std(c.oracle_ratio), *_mean_std(c.balanced),
                             *_mean_std(c.auroc)])
    _plot(cells, rows, epsilons, out / "comparison.png")
    return table


def _plot(cells: list[Cell], rows: Sequence[str], epsilons: Sequence[float],
          path: Path) -> None:
    from ..results.report import plt, save_figure

    by = {(c.variant, c.epsilon): c for c in cells}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, field, title in ((axes[0], "accuracy", "test accuracy: all clients"),
                             (axes[1], "balanced", "balanced accuracy: all clients"),
                             (axes[2], "minority", "test accuracy: minority clients")):
        for row in rows:
            xs = [e for e in epsilons if (row, e) in by and getattr(by[(row, e)], field)]
            means = [100 * np.mean(getattr(by[(row, e)], field)) for e in xs]
            stds = [100 * np.std(getattr(by[(row, e)], field)) for e in xs]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=row)
        ax.set_xlabel("epsilon (per client)")
        ax.set_title(f"mean {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("%")
    axes[2].legend(fontsize=8)
    save_figure(fig, path)
