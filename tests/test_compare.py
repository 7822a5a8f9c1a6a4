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
    assert run_config(rdpcfl, base, per_method)["learning-rate"] == 0.005


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
    assert "| global |" in table and "| local |" in table
    assert "**Privacy: the silos' noise multiplier z" in table
    with (out / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["method"] for r in rows} == {"global", "local"}
    assert all(0 < float(r["max_epsilon_spent"]) <= 5.0 and float(r["max_noise_multiplier"]) > 0
               for r in rows)
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
