"""The PLD store (docs/privacy.md#pld-accounting): a figure computed once per machine, read back
by other processes only for exactly its request and code, and never a cause of failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcfl_flwr.privacy import pld as pld_module
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.pld import pld_epsilon
from dpcfl_flwr.privacy.pld_store import STORE_VARIABLE, code_version
from dpcfl_flwr.privacy.schedule import two_stage_schedule

DELTA = 1e-4
# a short history: cheap to compose, and three kinds of mechanism in its key
RUNS = ((1.3, 0.08, 40), (2.0, 1.0, 1))
SELECTIONS = ((0.3, 2),)
PRINT_FIGURE = ("from dpcfl_flwr.privacy.pld import pld_epsilon; "
                f"print(repr(pld_epsilon({RUNS!r}, {SELECTIONS!r}, {DELTA!r})))")


@pytest.fixture(autouse=True)
def fresh_process_memory():
    """Every test starts with nothing remembered in this process."""
    pld_module._epsilon.cache_clear()
    yield
    pld_module._epsilon.cache_clear()


def _figure_without_store(monkeypatch) -> float:
    monkeypatch.delenv(STORE_VARIABLE, raising=False)
    pld_module._epsilon.cache_clear()
    return pld_epsilon(RUNS, SELECTIONS, DELTA)


def _entries(store: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(store.glob("*.json"))]


def test_a_figure_is_kept_once_and_read_back_by_another_process(tmp_path, monkeypatch):
    truth = _figure_without_store(monkeypatch)
    store = tmp_path / "store"
    monkeypatch.setenv(STORE_VARIABLE, str(store))
    pld_module._epsilon.cache_clear()
    assert pld_epsilon(RUNS, SELECTIONS, DELTA) == truth
    [entry] = _entries(store)
    assert entry["epsilon"] == truth and entry["delta"] == DELTA
    assert entry["code"] == code_version() and "dp-accounting" in entry["code"]
    # Another process reads the kept figure instead of composing: make the kept figure one
    # that composing could not give, and that one comes back (the store is trusted as the
    # ledger is, which is why it is the operator's own directory).
    [path] = store.glob("*.json")
    path.write_text(json.dumps({**entry, "epsilon": truth + 1.0}))
    shown = subprocess.run([sys.executable, "-c", PRINT_FIGURE], capture_output=True,
                           text=True, check=True, timeout=300,
                           env={**os.environ, STORE_VARIABLE: str(store)})
    assert float(shown.stdout) == truth + 1.0
    # ... and without the store, a process composes the true figure
    alone = subprocess.run([sys.executable, "-c", PRINT_FIGURE], capture_output=True,
                           text=True, check=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != STORE_VARIABLE})
    assert float(alone.stdout) == truth


@pytest.mark.parametrize("change", [
    {"code": "dp-accounting 0.0.1, pld.py 0000000000000000"},  # another release or source
    {"delta": 2e-4},  # another request under this request's name
    {"grid": 1e-3},
    {"epsilon": "9"},  # not a number
    {"epsilon": -1.0},
    None,  # not JSON at all
])
def test_an_entry_that_does_not_name_exactly_the_request_is_not_read(tmp_path, monkeypatch,
                                                                       change):
    truth = _figure_without_store(monkeypatch)
    store = tmp_path / "store"
    monkeypatch.setenv(STORE_VARIABLE, str(store))
    pld_module._epsilon.cache_clear()
    pld_epsilon(RUNS, SELECTIONS, DELTA)
    [path] = store.glob("*.json")
    entry = json.loads(path.read_text())
    path.write_text("{not json" if change is None else
                    json.dumps({**entry, **change, "epsilon": change.get("epsilon", 0.5)}))
    pld_module._epsilon.cache_clear()
    assert pld_epsilon(RUNS, SELECTIONS, DELTA) == truth
    assert _entries(store) == [entry]  # computed again and kept right


def test_a_store_that_cannot_be_written_only_costs_the_computation(tmp_path, monkeypatch):
    truth = _figure_without_store(monkeypatch)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(STORE_VARIABLE, str(blocked / "store"))  # under a file: no directory
    pld_module._epsilon.cache_clear()
    assert pld_epsilon(RUNS, SELECTIONS, DELTA) == truth


def test_a_calibration_through_the_store_plans_the_same_noise(tmp_path, monkeypatch):
    phases = two_stage_schedule(200, 32, 2, 3, "full")
    monkeypatch.delenv(STORE_VARIABLE, raising=False)
    alone = plan_noise(phases, 8.0, DELTA, select_rounds=1, mode="joint").noise_multiplier
    store = tmp_path / "store"
    monkeypatch.setenv(STORE_VARIABLE, str(store))
    for _ in range(2):  # the first fills the store, the second reads it
        pld_module._epsilon.cache_clear()
        assert plan_noise(phases, 8.0, DELTA, select_rounds=1,
                          mode="joint").noise_multiplier == alone
    assert len(_entries(store)) > 3  # the search's trial z and the fine check


# Waits for its go file, then asks for the figure; prints it and how often it composed one.
ASK_AT_ONCE = f"""
import sys, time
from pathlib import Path
import dpcfl_flwr.privacy.pld as pld
composed = []
compose = pld._composed_epsilon
pld._composed_epsilon = lambda *args: composed.append(1) or compose(*args)
Path(sys.argv[1] + ".ready").write_text("")
while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
print(repr(pld.pld_epsilon([(0.9, 0.1, 3000)], [], {DELTA!r})), len(composed))
"""


def test_processes_asking_at_once_compose_the_figure_once(tmp_path, monkeypatch):
    """A deployment's silos plan round 1 when it reaches them, at the same moment: the first
    to ask composes, the others wait for its entry (without the claim, each composed)."""
    monkeypatch.setenv(STORE_VARIABLE, str(tmp_path / "store"))
    go = tmp_path / "go"
    askers = [subprocess.Popen([sys.executable, "-c", ASK_AT_ONCE, str(tmp_path / f"p{i}"),
                                str(go)], stdout=subprocess.PIPE, text=True)
              for i in range(3)]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"p{i}.ready").exists() for i in range(3)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in askers)
        time.sleep(0.05)
    go.write_text("")
    answers = [asker.communicate(timeout=300)[0].split() for asker in askers]
    assert all(asker.returncode == 0 for asker in askers)
    assert len({figure for figure, _ in answers}) == 1
    assert sorted(int(count) for _, count in answers) == [0, 0, 1]
