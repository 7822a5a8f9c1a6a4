"""``dpcfl compare``: a grid of full simulations (methods x epsilons x seeds) and its tables.

Every run is its own ``dpcfl simulate`` process with its own results directory
``<out>/<method>/eps<eps>/seed<seed>/`` (on an aggregation axis, one row per method and rule:
``<out>/<method>-<rule>/eps<eps>/seed<seed>/``), so an interrupted grid resumes where it
stopped: a run with a complete ``results.json`` is kept (unless the grid's config of it changed
since), anything else is cleared and run again (its silos' ledgers must start empty, or they
would rightly refuse to train a second time).

The config file is a TOML table of run-config keys, each method's own parameters in its table
(``[rdpcfl]``, ``[ifca]``, ...), plus optional ``[method.<name>]`` tables of per-method
overrides of run-config keys (the paper tunes learning rate and batch size per method:
docs/experiments.md#training-hyper-parameters).
"""

from __future__ import annotations

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

from ..config import registry
from ..config.config_file import flat_keys, toml_value
from ..config.settings import ConfigError, parse_run_config


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


def _config_text(config: dict[str, Any]) -> str:
    return "".join(f"{k} = {toml_value(v)}\n" for k, v in config.items())


def changed_keys(run: GridRun, config: dict[str, Any]) -> list[str]:
    """The run-config keys whose values differ between the config a finished cell ran with
    (the ``seed<N>.toml`` beside it) and ``config``, the grid's now: an edited grid config
    re-runs its cells rather than tabulating stale ones. None known (no file): []."""
    try:
        before = tomllib.loads((run.directory.parent / f"seed{run.seed}.toml").read_text())
    except (OSError, ValueError):
        return []
    now = tomllib.loads(_config_text(config))
    return sorted(k for k in before.keys() | now.keys()
                  if k != "out-dir" and before.get(k) != now.get(k))


def execute(run: GridRun, config: dict[str, Any], cpus: int) -> None:
    """Run one cell as its own ``dpcfl simulate`` process (clean Ray, clean ledgers)."""
    if run.directory.exists():
        shutil.rmtree(run.directory)
    run.directory.mkdir(parents=True)
    config_file = run.directory.parent / f"seed{run.seed}.toml"
    config_file.write_text(_config_text(config))
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
        changed = changed_keys(run, configs[run]) if run.results() is not None else None
        if changed == []:
            report(f"[{index}/{len(runs)}] {run.label}: done earlier, kept")
            continue
        if changed:
            report(f"[{index}/{len(runs)}] {run.label}: done earlier with other "
                   f"{', '.join(changed)}; running it again")
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
               f"accuracy {percent(summary.get('mean_accuracy'))}, minority "
               f"{percent(summary.get('minority_accuracy'))}")
    return failed


def percent(value: float | None) -> str:
    """A fraction as a percentage with one decimal, "-" when unknown."""
    return "-" if value is None else f"{100 * value:.1f}%"


def parse_numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"cannot read the list {text!r}") from None
    if not values or any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ConfigError(f"cannot read the list {text!r}")
    return values
