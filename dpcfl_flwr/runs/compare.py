"""``dpcfl compare``: a grid of full simulations (methods x epsilons x seeds) and its tables.

Every run is its own ``dpcfl simulate`` process with its own results directory
``<out>/<method>/eps<eps>/seed<seed>/`` (on an aggregation axis, one row per method and rule:
``<out>/<method>-<rule>/eps<eps>/seed<seed>/``), so an interrupted grid resumes where it
stopped: a run with a complete ``results.json`` is kept (unless the grid's config of it changed
since), anything else is cleared and run again (its silos' ledgers must start empty, or they
would rightly refuse to train a second time). With ``--parallel K`` up to K cells run at
once, each still its own process and directory, so the layout, the resuming and the tables are
the same as one at a time; each cell's local Ray gets the grid's CPUs divided by K
(:func:`cell_cpus`), or every cell joins the same Ray cluster (``--ray-address``), whose
scheduler then shares its CPUs among the cells' silos.

Beside the methods asked for, the grid runs the baselines every table shows (:data:`BASELINES`:
``local``, what a silo learns alone, and ``majority``, the constant answer;
docs/algorithm.md#baselines) unless told not to; every task here is classification, so they
always apply.

The config file is a TOML table of run-config keys, each method's own parameters in its table
(``[rdpcfl]``, ``[ifca]``, ...), plus optional ``[method.<name>]`` tables of per-method
overrides of run-config keys (the paper tunes learning rate and batch size per method:
docs/experiments.md#training-hyper-parameters).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..config import registry
from ..config.config_file import flat_keys, toml_value
from ..config.settings import OPERATIONAL_KEYS, ConfigError, parse_run_config


def discovers_clusters(method: str) -> bool:
    """Whether ``method``'s results say if it recovered the cluster structure."""
    return registry.method_class(method).discovers_clusters


#: Methods every comparison table shows beside the ones asked for.
BASELINES = ("local", "majority")


def baselines_for(methods: Sequence[str]) -> list[str]:
    """The :data:`BASELINES` that ``methods`` leaves out, in order."""
    return [name for name in BASELINES if name not in methods]


@dataclass(frozen=True)
class GridRun:
    """One cell; ``rule``: the aggregation rule the grid sets (None: the run config's);
    ``baseline``: a baseline the grid added (:data:`BASELINES`), which combines no updates,
    so it runs with the uniform rule whatever the config names."""

    method: str
    epsilon: float
    seed: int
    directory: Path
    rule: str | None = None
    baseline: bool = False

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


def variants(methods: Sequence[str], rules: Sequence[str] | None,
             baselines: Sequence[str] = ()) -> list[str]:
    """The tables' rows in order: each method, or each (method, rule) on an aggregation axis,
    then the baselines the grid added."""
    return [variant(m, r) for m in methods for r in _axis(rules)] + list(baselines)


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
              out: Path, rules: Sequence[str] | None = None,
              baselines: Sequence[str] = ()) -> list[GridRun]:
    """Every cell; ``rules``: the aggregation axis (None: each run config's own rule). Whether
    a method can take a rule is the run config's to say (:func:`run_config`). ``baselines``:
    methods the grid adds (:func:`baselines_for`), one cell per epsilon and seed, off the
    aggregation axis."""
    names = registry.method_names()
    for method in [*methods, *baselines]:
        if method not in names:
            raise ConfigError(f"unknown method {method!r}; choose from {', '.join(names)}")
    if rules is not None and not rules:
        raise ConfigError("--aggregations names no rule")
    cells = [(m, r, False) for m in methods for r in _axis(rules)]
    cells += [(m, None, True) for m in baselines]
    return [GridRun(m, float(e), int(s),
                    out / (m if r is None else f"{m}-{r}") / f"eps{float(e):g}" / f"seed{int(s)}",
                    r, added)
            for e in epsilons for s in seeds for m, r, added in cells]


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
    elif run.baseline:  # it combines no updates: only the uniform rule applies to it
        raw[AXIS_KEY] = "uniform"
    return parse_run_config(raw).to_run_config()


def _config_text(config: dict[str, Any]) -> str:
    return "".join(f"{k} = {toml_value(v)}\n" for k, v in config.items())


def changed_keys(run: GridRun, config: dict[str, Any]) -> list[str]:
    """The run-config keys whose values differ between the config a finished cell ran with
    (the ``seed<N>.toml`` beside it) and ``config``, the grid's now: an edited grid config
    re-runs its cells rather than tabulating stale ones. Operational keys (where and with
    what a run computed, not what) do not count. None known (no file): []."""
    try:
        before = tomllib.loads((run.directory.parent / f"seed{run.seed}.toml").read_text())
    except (OSError, ValueError):
        return []
    now = tomllib.loads(_config_text(config))
    return sorted(k for k in before.keys() | now.keys()
                  if k not in OPERATIONAL_KEYS and before.get(k) != now.get(k))


def _launch(run: GridRun, config: dict[str, Any], cpus: int, ray_address: str | None
            ) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """Start one cell as its own ``dpcfl simulate`` process (clean Ray, clean ledgers), its
    output to ``seed<N>.log`` beside its directory; the process and the open log."""
    if run.directory.exists():
        shutil.rmtree(run.directory)
    run.directory.mkdir(parents=True)
    config_file = run.directory.parent / f"seed{run.seed}.toml"
    config_file.write_text(_config_text(config))
    command = [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--config", str(config_file),
               "--quiet", "--overwrite"]
    if ray_address is not None:
        command += ["--ray-address", ray_address]
    elif cpus:
        command += ["--cpus", str(cpus)]
    log = (run.directory.parent / f"seed{run.seed}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log


def _check_finished(run: GridRun, returncode: int, log: IO[str]) -> None:
    if returncode != 0 or run.results() is None:
        raise RuntimeError(f"{run.label} failed (exit {returncode}); see {log.name}")


def execute(run: GridRun, config: dict[str, Any], cpus: int,
            ray_address: str | None = None) -> None:
    """Run one cell to its end; RuntimeError naming its log when it failed."""
    process, log = _launch(run, config, cpus, ray_address)
    with log:
        try:
            returncode = process.wait()
        finally:
            _stop([process])
    _check_finished(run, returncode, log)


def run_grid(runs: Iterable[GridRun], base: dict[str, Any],
             per_method: dict[str, dict[str, Any]], cpus: int = 0,
             report: Callable[[str], None] = print, parallel: int = 1,
             ray_address: str | None = None) -> list[GridRun]:
    """Run every unfinished cell, ``parallel`` at once (:func:`cell_cpus` each, or on the
    Ray cluster at ``ray_address``); returns the cells that failed."""
    runs = list(runs)
    configs = {run: run_config(run, base, per_method) for run in runs}  # validate all first
    todo = []
    for index, run in enumerate(runs, 1):
        changed = changed_keys(run, configs[run]) if run.results() is not None else None
        if changed == []:
            report(f"[{index}/{len(runs)}] {run.label}: done earlier, kept")
            continue
        if changed:
            report(f"[{index}/{len(runs)}] {run.label}: done earlier with other "
                   f"{', '.join(changed)}; running it again")
        todo.append((f"[{index}/{len(runs)}]", run))
    each = cell_cpus(cpus, parallel, ray_address)
    if parallel > 1 and todo:
        report(f"{len(todo)} run(s) to do, {parallel} at once, "
               + ("sharing the Ray cluster" if ray_address is not None
                  else f"{each} CPU(s) for each"))
        return _run_in_parallel(todo, configs, each, parallel, ray_address, report)
    failed = []
    for tag, run in todo:
        started = time.monotonic()
        report(f"{tag} {run.label}: running ...")
        try:
            execute(run, configs[run], each, ray_address)
        except RuntimeError as exc:
            report(f"{tag} {exc}")
            failed.append(run)
            continue
        report(_finished_line(tag, run, time.monotonic() - started))
    return failed


def cell_cpus(cpus: int, parallel: int, ray_address: str | None) -> int:
    """Ray CPUs of each cell's own local Ray: the grid's (``cpus``, 0: the machine's) shared
    out, so that ``parallel`` cells train at most as many silos at once as there are CPUs
    (each silo one CPU and one torch thread by default). 0 (the cluster decides) with
    ``ray_address``, or when one cell at a time takes ``cpus`` as it is."""
    if ray_address is not None or (parallel == 1 and not cpus):
        return 0
    return max(1, (cpus or os.cpu_count() or 1) // parallel)


def _finished_line(tag: str, run: GridRun, seconds: float) -> str:
    summary = run.results()["summary"]  # type: ignore[index]
    return (f"{tag} {run.label}: {seconds:.0f} s, accuracy "
            f"{percent(summary.get('mean_accuracy'))}, balanced "
            f"{percent(summary.get('mean_balanced_accuracy'))}, minority "
            f"{percent(summary.get('minority_accuracy'))}")


@dataclass
class _Running:
    tag: str
    run: GridRun
    process: subprocess.Popen[bytes]
    log: IO[str]
    started: float


#: How often the parallel grid looks for cells that ended.
POLL_SECONDS = 0.5


def _run_in_parallel(todo: Sequence[tuple[str, GridRun]], configs: dict[GridRun, dict[str, Any]],
                     cpus: int, parallel: int, ray_address: str | None,
                     report: Callable[[str], None]) -> list[GridRun]:
    """Up to ``parallel`` cells at once, each its own process; a failed cell is reported and
    the others go on. On Ctrl-C or SIGTERM the running cells are stopped (their results
    directories stay incomplete, so a resumed grid runs them again)."""
    pending, running, failed = list(todo), list[_Running](), list[GridRun]()
    with _terminate_as_interrupt():
        try:
            while pending or running:
                while pending and len(running) < parallel:
                    tag, run = pending.pop(0)
                    report(f"{tag} {run.label}: running ...")
                    process, log = _launch(run, configs[run], cpus, ray_address)
                    running.append(_Running(tag, run, process, log, time.monotonic()))
                time.sleep(POLL_SECONDS)
                for cell in [c for c in running if c.process.poll() is not None]:
                    running.remove(cell)
                    cell.log.close()
                    try:
                        _check_finished(cell.run, cell.process.returncode, cell.log)
                    except RuntimeError as exc:
                        report(f"{cell.tag} {exc}")
                        failed.append(cell.run)
                        continue
                    report(_finished_line(cell.tag, cell.run, time.monotonic() - cell.started))
        finally:
            _stop([cell.process for cell in running])
            for cell in running:
                cell.log.close()
    return failed


#: How long a stopped cell may take to end (its simulation shuts Ray down) before it is killed.
STOP_SECONDS = 15.0


def _stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, SIGKILL those not gone after STOP_SECONDS."""
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for process in alive:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises KeyboardInterrupt (as Ctrl-C does), so the
    grid's ``finally`` stops its cells instead of leaving them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
