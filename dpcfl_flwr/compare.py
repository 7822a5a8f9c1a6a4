"""``dpcfl compare``: a grid of full simulations (methods x epsilons x seeds) and its tables.

Every run is its own ``dpcfl simulate`` process with its own results directory
``<out>/<method>/eps<eps>/seed<seed>/`` (on an aggregation axis, one row per method and rule:
``<out>/<method>-<rule>/eps<eps>/seed<seed>/``), so an interrupted grid resumes where it
stopped: a run with a complete ``results.json`` is kept, anything else is cleared and run again
(its silos' ledgers must start empty, or they would rightly refuse to train a second time).

The config file is a TOML table of run-config keys, each method's own parameters in its table
(``[rdpcfl]``, ``[ifca]``, ...), plus optional ``[method.<name>]`` tables of per-method
overrides of run-config keys (the paper tunes learning rate and batch size per method:
docs/experiments.md#training-hyper-parameters).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import registry
from .config import ConfigError, parse_run_config
from .simulation import _toml_value, flat_keys


def discovers_clusters(method: str) -> bool:
    """Whether ``method``'s results say if it recovered the cluster structure."""
    return registry.method_class(method).discovers_clusters


@dataclass(frozen=True)
class GridRun:
    """One cell; ``rule``: the aggregation rule the grid sets (None: the run config's)."""

    method: str
    epsilon: float
    seed: int
    directory: Path
    rule: str | None = None

    @property
    def variant(self) -> str:
        """The row of the tables: ``global``, or ``global/robust-hdp`` on an aggregation axis."""
        return variant(self.method, self.rule)

    @property
    def label(self) -> str:
        return f"{self.variant} eps={self.epsilon:g} seed={self.seed}"

    def results(self) -> dict[str, Any] | None:
        """The run's results when it finished, else None."""
        path = self.directory / "results.json"
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return results if results.get("complete") else None


def load_grid_config(path: str | Path | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Base run-config keys and per-method overrides from a compare config file."""
    if path is None:
        return {}, {}
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    # `method = "..."` is a run-config key (overridden per grid cell); `[method.<name>]` tables
    # hold per-method overrides.
    per_method = data.pop("method") if isinstance(data.get("method"), dict) else {}
    names = registry.method_names()
    unknown = sorted(set(per_method) - set(names))
    if unknown:
        raise ConfigError(f"{path}: unknown method table(s) {unknown} (methods: "
                          f"{', '.join(names)})")
    return flat_keys(data), {name: flat_keys(table) for name, table in per_method.items()}


GRID_KEYS = ("method", "epsilon", "seed", "out-dir")
#: The run-config key of the optional aggregation axis (``--aggregations``).
AXIS_KEY = "aggregation"


def variant(method: str, rule: str | None) -> str:
    return method if rule is None else f"{method}/{rule}"


def variants(methods: Sequence[str], rules: Sequence[str] | None) -> list[str]:
    """The tables' rows in order: each method, or each (method, rule) on an aggregation axis."""
    return [variant(m, r) for m in methods for r in _axis(rules)]


def apply_overrides(base: dict[str, Any], per_method: dict[str, dict[str, Any]],
                    overrides: dict[str, Any], axis: bool = False
                    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--set key=value`` pairs win over the config file and its method tables, so a variant
    of a whole grid (``--set budget-mode=joint``) needs no second config file. The grid's own
    coordinates are set by --methods/--epsilons/--seeds/--out (and ``aggregation`` by
    --aggregations when ``axis``), never by --set."""
    fixed = sorted(set(overrides) & {*GRID_KEYS, *([AXIS_KEY] if axis else [])})
    if fixed:
        raise ConfigError(f"--set cannot change {', '.join(fixed)}: the grid sets it "
                          "(use --methods, --epsilons, --seeds, "
                          f"{'--aggregations, ' if axis else ''}--out)")
    return ({**base, **overrides},
            {method: {**table, **overrides} for method, table in per_method.items()})


def plan_grid(methods: Sequence[str], epsilons: Sequence[float], seeds: Sequence[int],
              out: Path, rules: Sequence[str] | None = None) -> list[GridRun]:
    """Every cell; ``rules``: the aggregation axis (None: each run config's own rule). Whether
    a method can take a rule is the run config's to say (:func:`run_config`)."""
    names = registry.method_names()
    for method in methods:
        if method not in names:
            raise ConfigError(f"unknown method {method!r}; choose from {', '.join(names)}")
    if rules is not None and not rules:
        raise ConfigError("--aggregations names no rule")
    return [GridRun(m, float(e), int(s),
                    out / (m if r is None else f"{m}-{r}") / f"eps{float(e):g}" / f"seed{int(s)}",
                    r)
            for e in epsilons for s in seeds for m in methods for r in _axis(rules)]


def _axis(rules: Sequence[str] | None) -> Sequence[str | None]:
    return [None] if rules is None else rules


def run_config(run: GridRun, base: dict[str, Any], per_method: dict[str, dict[str, Any]]
               ) -> dict[str, Any]:
    """The validated run config of one grid cell (raises ConfigError on bad keys, or on a
    rule its method cannot take)."""
    raw = {**base, **per_method.get(run.method, {}), "method": run.method,
           "epsilon": run.epsilon, "seed": run.seed, "out-dir": str(run.directory.resolve())}
    if run.rule is not None:
        raw[AXIS_KEY] = run.rule
    return parse_run_config(raw).to_run_config()


def execute(run: GridRun, config: dict[str, Any], cpus: int) -> None:
    """Run one cell as its own ``dpcfl simulate`` process (clean Ray, clean ledgers)."""
    if run.directory.exists():
        shutil.rmtree(run.directory)
    run.directory.mkdir(parents=True)
    config_file = run.directory.parent / f"seed{run.seed}.toml"
    config_file.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in config.items()))
    command = [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--config", str(config_file),
               "--quiet", "--overwrite"]
    if cpus:
        command += ["--cpus", str(cpus)]
    log = (run.directory.parent / f"seed{run.seed}.log").open("w")
    with log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0 or run.results() is None:
        raise RuntimeError(f"{run.label} failed (exit {completed.returncode}); see {log.name}")


def run_grid(runs: Iterable[GridRun], base: dict[str, Any],
             per_method: dict[str, dict[str, Any]], cpus: int = 0,
             report: Callable[[str], None] = print) -> list[GridRun]:
    """Run every unfinished cell; returns the cells that failed."""
    runs = list(runs)
    configs = {run: run_config(run, base, per_method) for run in runs}  # validate all first
    failed = []
    for index, run in enumerate(runs, 1):
        if run.results() is not None:
            report(f"[{index}/{len(runs)}] {run.label}: done earlier, kept")
            continue
        started = time.monotonic()
        report(f"[{index}/{len(runs)}] {run.label}: running ...")
        try:
            execute(run, configs[run], cpus)
        except RuntimeError as exc:
            report(f"[{index}/{len(runs)}] {exc}")
            failed.append(run)
            continue
        summary = run.results()["summary"]  # type: ignore[index]
        report(f"[{index}/{len(runs)}] {run.label}: {time.monotonic() - started:.0f} s, "
               f"accuracy {_percent(summary.get('mean_accuracy'))}, minority "
               f"{_percent(summary.get('minority_accuracy'))}")
    return failed


# --- tables -------------------------------------------------------------------------------------
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
        _known(mean_oracle_ratio(r) for r in results))


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


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _mean_std(values: list[float]) -> tuple[float | str, float | str]:
    return (float(np.mean(values)), float(np.std(values))) if values else ("", "")


def _pm(values: list[float], form: str = "percent") -> str:
    """mean ± std: of percentages, in scientific notation ("sci") or of plain ratios."""
    if not values:
        return "-"
    mean, std = float(np.mean(values)), float(np.std(values))
    if form == "sci":
        return f"{mean:.2e} ± {std:.1e}"
    if form == "ratio":
        return f"{mean:.2f} ± {std:.2f}"
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
             grid("**Mean test accuracy over the minority clients (%)** (mean ± std over seeds)",
                  lambda c: _pm(c.minority))]
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
               "noise_vs_oracle_mean", "noise_vs_oracle_std")


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
                             *_mean_std(c.oracle_ratio)])
    _plot(cells, rows, epsilons, out / "comparison.png")
    return table


def _plot(cells: list[Cell], rows: Sequence[str], epsilons: Sequence[float],
          path: Path) -> None:
    from .report import plt, save_figure

    by = {(c.variant, c.epsilon): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, field, title in ((axes[0], "accuracy", "all clients"),
                             (axes[1], "minority", "minority clients")):
        for row in rows:
            xs = [e for e in epsilons if (row, e) in by and getattr(by[(row, e)], field)]
            means = [100 * np.mean(getattr(by[(row, e)], field)) for e in xs]
            stds = [100 * np.std(getattr(by[(row, e)], field)) for e in xs]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=row)
        ax.set_xlabel("epsilon (per client)")
        ax.set_title(f"mean test accuracy: {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].legend(fontsize=8)
    save_figure(fig, path)


def parse_numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"cannot read the list {text!r}") from None
    if not values or any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ConfigError(f"cannot read the list {text!r}")
    return values
