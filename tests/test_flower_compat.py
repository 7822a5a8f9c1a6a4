"""Flower's internals stay in ``dpcfl_flwr/flower_compat/``, behind its one version gate.

Outside that package the code imports public Flower only; with the tuning switched off
(``DPCFL_FLOWER_TUNING=0``) or on another Flower release nothing internal is loaded, one line
says so, and a real simulation still runs on stock Flower; the app pin keeps refusing.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dpcfl_flwr"
FENCE = PACKAGE / "flower_compat"
BENCH = PACKAGE.parent / "bench"
#: Flower's public API: ``flwr.simulation`` for its public names only.
PUBLIC = {"flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp",
          "flwr.simulation"}
#: What the tuning loads and stock Flower does not (measured: see the control run below).
TUNED_MODULES = ["dpcfl_flwr.flower_compat.engine", "flwr.superlink.grid.inmemory_grid",
                 "ray._private.utils"]
SWITCHED_OFF_LINE = "Flower tuning switched off (DPCFL_FLOWER_TUNING=0)"
OTHER_RELEASE_LINE = "Flower 1.40.0 is installed, the tuning is written for 1.39.0"
#: Runs the package's public face as the app does, then names every tuned module loaded.
PROBE = """
import json, sys
import dpcfl_flwr.server_app, dpcfl_flwr.client_app, dpcfl_flwr.runs.simulation
from dpcfl_flwr import flower_compat
flower_compat.in_process_grid(object())
flower_compat.wait_for_replies(object(), 0.0)
flower_compat.array_chunk_size()
with flower_compat.signals_left_to_caller():
    pass
print(json.dumps([flower_compat.gate.TUNING, [m for m in TUNED if m in sys.modules]]))
""".replace("TUNED", repr(TUNED_MODULES))
#: Makes the gate read another installed Flower release (before anything imports it).
OTHER_RELEASE = """
import importlib.metadata
_version = importlib.metadata.version
importlib.metadata.version = lambda name: "1.40.0" if name == "flwr" else _version(name)
"""


def private_flower_imports(source: str) -> list[str]:
    """The non-public Flower modules and names ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if a.name.startswith("_")]
        else:
            continue
        found += [name for name in names if (name == "flwr" or name.startswith("flwr."))
                  and (name not in PUBLIC or name.rsplit(".", 1)[-1].startswith("_"))]
    return found


def test_the_checker_finds_each_kind_of_private_import():
    assert private_flower_imports("from flwr.app import Message\nimport flwr.clientapp") == []
    assert private_flower_imports("from flwr.supercore.constant import X") == [
        "flwr.supercore.constant"]
    assert private_flower_imports("import flwr") == ["flwr"]
    assert private_flower_imports("def f():\n    from flwr.simulation import _run_simulation"
                                  ) == ["flwr.simulation._run_simulation"]
    assert private_flower_imports("from flwr.superlink.grid import InMemoryGrid") == [
        "flwr.superlink.grid"]


def test_no_module_outside_flower_compat_imports_private_flower():
    """The package and the benchmarks: whatever needs Flower's internals goes through the
    fence, so a Flower upgrade is checked in one place."""
    offenders = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *BENCH.rglob("*.py")]):
        if FENCE in path.parents:
            continue
        source = path.read_text()
        found = private_flower_imports(source)
        if "_run_simulation" in source:
            found.append("_run_simulation")
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}, f"move these into dpcfl_flwr/flower_compat/: {offenders}"


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def _gate_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "the app runs on stock Flower" in line]


def test_switched_off_the_app_loads_nothing_the_tuning_would():
    tuned = _python(PROBE, DPCFL_FLOWER_TUNING="1")
    assert json.loads(tuned.stdout) == [True, TUNED_MODULES], tuned.stderr  # the control
    assert _gate_lines(tuned.stderr) == []
    stock = _python(PROBE, DPCFL_FLOWER_TUNING="0")
    assert json.loads(stock.stdout) == [False, []], stock.stderr
    assert len(_gate_lines(stock.stderr)) == 1
    assert SWITCHED_OFF_LINE in _gate_lines(stock.stderr)[0]


def test_another_flower_release_gets_stock_flower_with_one_line():
    other = _python(OTHER_RELEASE + PROBE)
    assert json.loads(other.stdout) == [False, []], other.stderr
    assert [OTHER_RELEASE_LINE in line for line in _gate_lines(other.stderr)] == [True]


def test_another_flower_release_keeps_the_app_pin_refusing():
    """Latency tuning may be skipped; a silo without the app pin may not run at all."""
    refused = _python(OTHER_RELEASE + "from dpcfl_flwr.deploy.supernode_launcher import main\n"
                      "main(['--superlink', '127.0.0.1:9', '--insecure'])")
    assert refused.returncode == 2, refused.stderr
    assert "cannot start this silo: the app pin needs flwr 1.39.0's SuperNode, not 1.40.0" in (
        refused.stderr)


@pytest.mark.slow
def test_a_small_simulation_runs_on_stock_flower(tmp_path):
    out = tmp_path / "run"
    settings = ['method="global"', 'clusters="2,2"', "samples-per-client=64",
                "test-samples=40", "num-server-rounds=2", "eval-every=2"]
    run = subprocess.run(
        [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--quiet", "--cpus", "2",
         "--out", str(out), *[arg for s in settings for arg in ("--set", s)]],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "DPCFL_FLOWER_TUNING": "0"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(_gate_lines(run.stderr)) == 1
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True and results["method"] == "global"
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert (out / "rounds.csv").is_file() and (out / "ledgers").is_dir()
