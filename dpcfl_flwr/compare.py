"""``dpcfl compare``: a grid of full simulations (methods x epsilons x seeds) and its tables.

Every run is its own ``dpcfl simulate`` process with its own results directory
``<out>/<method>/eps<eps>/seed<seed>/``, so an interrupted grid resumes where it stopped: a run
with a complete ``results.json`` is kept, anything else is cleared and run again (its silos'
ledgers must start empty, or they would rightly refuse to train a second time).

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
    method: str
    epsilon: float
    seed: int
    directory: Path

    @property
    def label(self) -> str:
        return f"{self.method} eps={self.epsilon:g} seed={self.seed}"

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


def apply_overrides(base: dict[str, Any], per_method: dict[str, dict[str, Any]],
                    overrides: dict[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--set key=value`` pairs win over the config file and its method tables, so a variant
    of a whole grid (``--set budget-mode=joint``) needs no second config file. The grid's own
    coordinates are set by --methods/--epsilons/--seeds/--out, never by --set."""
    fixed = sorted(set(overrides) & set(GRID_KEYS))
    if fixed:
        raise ConfigError(f"--set cannot change {', '.join(fixed)}: the grid sets it "
                          "(use --methods, --epsilons, --seeds, --out)")
    return ({**base, **overrides},
            {method: {**table, **overrides} for method, table in per_method.items()})


def plan_grid(methods: Sequence[str], epsilons: Sequence[float], seeds: Sequence[int],
              out: Path) -> list[GridRun]:
    names = registry.method_names()
    for method in methods:
        if method not in names:
            raise ConfigError(f"unknown method {method!r}; choose from {', '.join(names)}")
    return [GridRun(m, float(e), int(s), out / m / f"eps{float(e):g}" / f"seed{int(s)}")
            for e in epsilons for s in seeds for m in methods]


def run_config(run: GridRun, base: dict[str, Any], per_method: dict[str, dict[str, Any]]
               ) -> dict[str, Any]:
    """The validated run config of one grid cell (raises ConfigError on bad keys)."""
    raw = {**base, **per_method.get(run.method, {}), "method": run.method,
           "epsilon": run.epsilon, "seed": run.seed, "out-dir": str(run.directory.resolve())}
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
    """One (method, epsilon) over its seeds."""

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


def collect(runs: Iterable[GridRun]) -> list[Cell]:
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in runs:
        finished = run.results()
        if finished is not None:
            groups.setdefault((run.method, run.epsilon), []).append(finished)
    cells = []
    for (method, epsilon), results in groups.items():
        summaries = [r["summary"] for r in results]
        clustered = discovers_clusters(method)
        cells.append(Cell(  # a run without a minority (or unknown figures) adds none
            method, epsilon, _known(s.get("mean_accuracy") for s in summaries),
            _known(s.get("minority_accuracy") for s in summaries),
            sum(bool(r["clustering"].get("found_structure")) for r in results)
            if clustered else None,
            sum(bool(r["clustering"].get("minority_isolated")) for r in results)
            if clustered else None,
            len(results),
            [max((c["noise_multiplier"] for c in r["clients"]
                  if c.get("noise_multiplier") is not None), default=0.0) for r in results],
            [s.get("max_epsilon_spent") or 0.0 for s in summaries]))
    return cells


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _mean_std(values: list[float]) -> tuple[float | str, float | str]:
    return (float(np.mean(values)), float(np.std(values))) if values else ("", "")


def _pm(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}"


def markdown(cells: list[Cell], methods: Sequence[str], epsilons: Sequence[float]) -> str:
    """The paper's form: accuracy (all / minority clients) per method and eps, and detections."""
    by = {(c.method, c.epsilon): c for c in cells}
    header = "| method | " + " | ".join(f"eps={e:g}" for e in epsilons) + " |"
    rule = "|---|" + "---|" * len(epsilons)
    parts = []
    for title, field in (("Mean test accuracy over all clients (%)", "accuracy"),
                         ("Mean test accuracy over the minority clients (%)", "minority")):
        rows = [f"| {m} | " + " | ".join(
            _pm(getattr(by[(m, e)], field)) if (m, e) in by else "-" for e in epsilons) + " |"
            for m in methods]
        parts.append(f"**{title}** (mean ± std over seeds)\n\n{header}\n{rule}\n" +
                     "\n".join(rows))
    detecting = [m for m in methods if discovers_clusters(m)]
    if detecting:
        rows = [f"| {m} | " + " | ".join(
            f"{by[(m, e)].found_structure}/{by[(m, e)].seeds} · "
            f"{by[(m, e)].minority_isolated}/{by[(m, e)].seeds}"
            if (m, e) in by else "-" for e in epsilons) + " |" for m in detecting]
        parts.append("**Seeds that found the full cluster structure · that isolated the "
                     f"minority cluster**\n\n{header}\n{rule}\n" + "\n".join(rows))
    rows = [f"| {m} | " + " | ".join(
        f"{max(by[(m, e)].noise):.3g} · {max(by[(m, e)].spent):.2f}"
        if (m, e) in by and by[(m, e)].spent else "-" for e in epsilons) + " |" for m in methods]
    parts.append("**Privacy: the silos' noise multiplier z · the largest epsilon a silo spent** "
                 "(largest over seeds, from the silos' own ledgers)\n\n"
                 f"{header}\n{rule}\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def write_reports(cells: list[Cell], methods: Sequence[str], epsilons: Sequence[float],
                  out: Path) -> str:
    table = markdown(cells, methods, epsilons)
    (out / "summary.md").write_text(table)
    with (out / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "epsilon", "seeds", "accuracy_mean", "accuracy_std",
                         "minority_mean", "minority_std", "found_structure",
                         "minority_isolated", "max_noise_multiplier", "max_epsilon_spent"])
        for c in sorted(cells, key=lambda c: (c.method, c.epsilon)):
            writer.writerow([c.method, c.epsilon, c.seeds, *_mean_std(c.accuracy),
                             *_mean_std(c.minority),
                             "" if c.found_structure is None else c.found_structure,
                             "" if c.minority_isolated is None else c.minority_isolated,
                             max(c.noise, default=""), max(c.spent, default="")])
    _plot(cells, methods, epsilons, out / "comparison.png")
    return table


def _plot(cells: list[Cell], methods: Sequence[str], epsilons: Sequence[float],
          path: Path) -> None:
    from .report import plt, save_figure

    by = {(c.method, c.epsilon): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, field, title in ((axes[0], "accuracy", "all clients"),
                             (axes[1], "minority", "minority clients")):
        for method in methods:
            xs = [e for e in epsilons if (method, e) in by and getattr(by[(method, e)], field)]
            means = [100 * np.mean(getattr(by[(method, e)], field)) for e in xs]
            stds = [100 * np.std(getattr(by[(method, e)], field)) for e in xs]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=method)
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
