"""`dpcfl compare`: the grid, its validation, and resuming after an interruption."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcfl_flwr.config.settings import ConfigError
from dpcfl_flwr.runs import compare
from dpcfl_flwr.runs.compare import (
    GridRun,
    apply_overrides,
    changed_keys,
    load_grid_config,
    plan_grid,
    run_config,
    run_grid,
)

TINY = """clusters = "2,2"
samples-per-client = 64
num-server-rounds = 2
test-samples = 40
eval-every = 2

[rdpcfl]
n-clusters = 2

[method.local]
learning-rate = 0.01
"""


def test_grid_layout_and_per_method_overrides(tmp_path):
    config = tmp_path / "grid.toml"
    config.write_text(TINY)
    base, per_method = load_grid_config(config)
    runs = plan_grid(["rdpcfl", "local"], [5, 10], [0, 1], tmp_path / "out")
    assert len(runs) == 8
    assert runs[0].directory == tmp_path / "out" / "rdpcfl" / "eps5" / "seed0"
    local = next(r for r in runs if r.method == "local")
    assert run_config(local, base, per_method)["learning-rate"] == 0.01
    rdpcfl = next(r for r in runs if r.method == "rdpcfl")
    assert run_config(rdpcfl, base, per_method)["learning-rate"] == 0.0  # each silo chooses


def test_set_overrides_win_over_the_file_and_its_method_tables(tmp_path):
    config = tmp_path / "grid.toml"
    config.write_text(TINY)
    base, per_method = apply_overrides(*load_grid_config(config),
                                       {"learning-rate": 0.02, "budget-mode": "joint"})
    for run in plan_grid(["rdpcfl", "local"], [5], [0], tmp_path / "out"):
        cell = run_config(run, base, per_method)
        assert cell["learning-rate"] == 0.02 and cell["budget-mode"] == "joint"
    with pytest.raises(ConfigError, match="--set cannot change epsilon, seed"):
        apply_overrides(base, per_method, {"seed": 3, "epsilon": 1.0})


def test_a_finished_cell_is_kept_only_while_its_config_is_unchanged(tmp_path, monkeypatch):
    config = tmp_path / "grid.toml"
    config.write_text(TINY)
    base, per_method = load_grid_config(config)
    run = plan_grid(["global"], [5], [0], tmp_path / "out")[0]
    ran_with = run_config(run, base, per_method)
    run.directory.mkdir(parents=True)  # a finished cell, as execute() leaves it
    (run.directory.parent / "seed0.toml").write_text(compare._config_text(ran_with))
    (run.directory / "results.json").write_text(json.dumps({"complete": True, "summary": {}}))
    assert changed_keys(run, ran_with) == []
    assert changed_keys(run, {**ran_with, "out-dir": "/elsewhere"}) == []  # moved: same run
    edited, _ = apply_overrides(base, per_method, {"num-server-rounds": 3, "delta": 1e-6})
    assert changed_keys(run, run_config(run, edited, per_method)) == ["delta",
                                                                      "num-server-rounds"]
    started, said = [], []
    monkeypatch.setattr(compare, "execute", lambda cell, *_: started.append(cell))
    run_grid([run], base, per_method, report=said.append)
    assert not started and said == ["[1/1] global eps=5 seed=0: done earlier, kept"]
    run_grid([run], edited, per_method, report=said.append)
    assert started == [run]
    assert "done earlier with other delta, num-server-rounds; running it again" in said[1]


def test_bad_grid_configs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown method"):
        plan_grid(["fedavg"], [5], [0], tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text('[method.ifcaa]\nlearning-rate = 0.1\n')
    with pytest.raises(ConfigError, match="unknown method table"):
        load_grid_config(bad)
    bad.write_text("epsilonn = 3\n")
    base, per_method = load_grid_config(bad)
    with pytest.raises(ConfigError, match="unknown key 'epsilonn'"):
        run_config(plan_grid(["global"], [5], [0], tmp_path)[0], base, per_method)


def _finished(run: GridRun, accuracy: float, balanced: float, area: float | None) -> None:
    """A finished cell's results.json, with the summary a run writes."""
    run.directory.mkdir(parents=True, exist_ok=True)
    (run.directory / "results.json").write_text(json.dumps({
        "complete": True, "method": run.method, "config": {"method": run.method},
        "clients": [{"noise_multiplier": 1.0}], "rounds": [], "clustering": {},
        "summary": {"mean_accuracy": accuracy, "minority_accuracy": None,
                    "mean_balanced_accuracy": balanced, "mean_auroc": area,
                    "max_epsilon_spent": 4.9}}))


def test_the_baselines_join_every_grid_off_its_aggregation_axis(tmp_path):
    assert compare.baselines_for(["rdpcfl", "global"]) == ["local", "majority"]
    assert compare.baselines_for(["local", "global"]) == ["majority"]
    added = compare.baselines_for(["global"])
    runs = plan_grid(["global"], [5], [0], tmp_path, ["uniform", "robust-hdp"], added)
    assert [(r.method, r.rule, r.baseline) for r in runs] == [
        ("global", "uniform", False), ("global", "robust-hdp", False),
        ("local", None, True), ("majority", None, True)]
    assert runs[3].directory == tmp_path / "majority" / "eps5" / "seed0"
    assert compare.variants(["global"], ["uniform", "robust-hdp"], added) == [
        "global/uniform", "global/robust-hdp", "local", "majority"]
    # a baseline combines no updates: the config's rule does not apply to it
    base = {"aggregation": "samples"}
    assert [run_config(r, base, {})["aggregation"] for r in runs] == [
        "uniform", "robust-hdp", "uniform", "uniform"]
    assert run_config(runs[3], {}, {})["majority.select-ratio"] == 0.05
    asked = plan_grid(["local"], [5], [0], tmp_path)[0]  # asked for by name: as before
    with pytest.raises(ConfigError, match="method local combines its updates its own way"):
        run_config(asked, base, {})


def test_the_tables_put_the_baselines_beside_the_methods_with_balanced_accuracy_and_auroc(
        tmp_path):
    from dpcfl_flwr.runs.compare_report import collect, write_reports

    added = compare.baselines_for(["global"])
    runs = plan_grid(["global"], [5], [0, 1], tmp_path, None, added)
    figures = {"global": (0.90, 0.62, 0.81), "local": (0.86, 0.70, 0.77),
               "majority": (0.80, 0.50, 0.50)}
    for run in runs:
        accuracy, balanced, area = figures[run.method]
        _finished(run, accuracy + 0.01 * run.seed, balanced + 0.02 * run.seed, area)
    table = write_reports(collect(runs), compare.variants(["global"], None, added), [5.0],
                          tmp_path)
    sections = {part.lstrip("*").split("**")[0]: part for part in table.split("\n\n**")}
    accuracy = next(v for k, v in sections.items() if k.startswith("Mean test accuracy over all"))
    balanced = next(v for k, v in sections.items() if k.startswith("Mean balanced accuracy"))
    auroc = next(v for k, v in sections.items() if k.startswith("Mean AUROC"))
    assert "| global | 90.5 ± 0.5 |" in accuracy and "| majority | 80.5 ± 0.5 |" in accuracy
    assert "| local | 71.0 ± 1.0 |" in balanced and "| majority | 51.0 ± 1.0 |" in balanced
    assert "| global | 0.810 ± 0.000 |" in auroc and "| majority | 0.500 ± 0.000 |" in auroc
    assert table.index("| global |") < table.index("| local |") < table.index("| majority |")
    with (tmp_path / "summary.csv").open() as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"global", "local", "majority"}
    assert float(rows["majority"]["balanced_accuracy_mean"]) == pytest.approx(0.51)
    assert float(rows["local"]["auroc_mean"]) == pytest.approx(0.77)


@pytest.mark.parametrize("option, expected", [((), {"global", "local", "majority"}),
                                              (("--no-baselines",), {"global"})])
def test_dpcfl_compare_runs_the_baselines_unless_told_not_to(tmp_path, monkeypatch, option,
                                                             expected):
    from typer.testing import CliRunner

    from dpcfl_flwr.cli import app

    ran: list[str] = []

    def execute(run: GridRun, *_: object) -> None:
        ran.append(run.method)
        _finished(run, 0.7, 0.6, None)

    monkeypatch.setattr(compare, "execute", execute)
    out = tmp_path / "out"
    shown = CliRunner().invoke(app, ["compare", "--methods", "global", "--epsilons", "5",
                                     "--seeds", "0", "--out", str(out), *option])
    assert shown.exit_code == 0, shown.output
    assert set(ran) == expected
    table = (out / "summary.md").read_text()
    assert {m for m in ("global", "local", "majority") if f"| {m} |" in table} == expected
    assert "Mean balanced accuracy" in table and "AUROC" not in table  # ten classes


def _compare(config: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dpcfl_flwr.cli", "compare", "--methods", "global,local",
         "--epsilons", "5", "--seeds", "0", "--config", str(config), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_an_interrupted_grid_resumes_without_redoing_finished_runs(tmp_path):
    config, out = tmp_path / "grid.toml", tmp_path / "out"
    config.write_text(TINY)
    first, second = (GridRun(m, 5.0, 0, out / m / "eps5" / "seed0") for m in ("global", "local"))
    process = _compare(config, out)
    deadline = time.monotonic() + 600
    while first.results() is None:  # let the first run finish, then interrupt the second
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert second.results() is None
    finished_at = (first.directory / "results.json").stat().st_mtime

    resumed = _compare(config, out)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output
    assert "global eps=5 seed=0: done earlier, kept" in output
    assert (first.directory / "results.json").stat().st_mtime == finished_at
    assert second.results() is not None
    table = (out / "summary.md").read_text()
    assert "| global |" in table and "| local |" in table and "| majority |" in table
    assert "**Privacy: the silos' noise multiplier z" in table
    with (out / "summary.csv").open() as handle:
        rows = {r["method"]: r for r in csv.DictReader(handle)}
    assert set(rows) == {"global", "local", "majority"}  # the grid adds the majority class
    assert all(0 < float(r["max_epsilon_spent"]) <= 5.0 and float(r["max_noise_multiplier"]) > 0
               for m, r in rows.items() if m != "majority")
    # the majority baseline: no DP-SGD, one selection at 5% of the budget, balanced accuracy
    # no better than chance over the classes present
    majority = rows["majority"]
    assert float(majority["max_noise_multiplier"]) == 0.0
    assert 0 < float(majority["max_epsilon_spent"]) <= 0.05 * 5.0 + 1e-6
    assert float(majority["balanced_accuracy_mean"]) <= 0.5
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
