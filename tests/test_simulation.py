"""The quick example, shrunk, through Flower's real simulation engine (Ray) on Fashion-MNIST.

One silo starts with a ledger that has already spent nearly all of its budget (an earlier run
on the same data): it must refuse to train, the server must log it and go on with the others,
and no silo may ever report more epsilon than its budget.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.privacy.accountants import DEFAULT_ACCOUNTANT, accountant_named
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger
from dpcfl_flwr.privacy.schedule import GaussianPhase
from dpcfl_flwr.runs.simulation import run_simulation

ROUNDS = 8
SHRUNK = {
    "clusters": "2,3,3", "rdpcfl.n-clusters": 3, "samples-per-client": 400,
    "num-server-rounds": ROUNDS,
    "test-samples": 300, "eval-every": 4, "rdpcfl.select-window": 0.25, "epsilon": 10.0,
}
EXHAUSTED = 4  # a majority silo: the run must go on without it


def _nearly_spent_ledger(path: Path) -> float:
    """A ledger at eps = 9.993 of 10 from an earlier run: less than this run's two private
    selections cost, so no noise level can fit the run (a silo with more left would instead
    calibrate a larger z for what remains)."""
    ledger = PrivacyLedger(meta={"note": "earlier run"})
    # one full-batch step at 9.993 by the silos' (default) accountant: PLD measures a
    # Gaussian tighter than RDP did (z 0.5249 under the authors' accounting)
    z = accountant_named(DEFAULT_ACCOUNTANT).calibrate([GaussianPhase(1.0, 1)], 9.993, 1e-4)
    ledger.record([GaussianSteps(z, 1.0, 1, round=1)])
    spent = ledger.spent(PrivacyBudget(10.0, 1e-4))
    assert 9.99 < spent < 10.0
    ledger.save(path)
    return spent


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "run"
    spent_before = _nearly_spent_ledger(out / "ledgers" / f"silo-{EXHAUSTED}.json")
    experiment = parse_run_config({**SHRUNK, "out-dir": str(out)})
    run_simulation(experiment)
    return out, json.loads((out / "results.json").read_text()), spent_before


@pytest.mark.slow
def test_results_file_of_a_real_simulation(simulated):
    out, results, _ = simulated
    assert results["complete"] is True and results["method"] == "rdpcfl"
    assert [r["round"] for r in results["rounds"]] == list(range(1, ROUNDS + 1))
    assert [r["stage"] for r in results["rounds"]][0] == "clustering"
    clients = {c["partition"]: c for c in results["clients"]}
    assert sorted(clients) == list(range(8))
    assert [clients[p]["true_cluster"] for p in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]
    for client in clients.values():
        assert 0.0 <= client["test_accuracy"] <= 1.0
        assert 0 <= client["final_cluster"] < 3
    clustering = results["clustering"]
    for key in ("mss", "mpo", "n_clusters", "switch_round", "em_iterations", "ari"):
        assert key in clustering
    assert clustering["switch_round"] == int((1 - clustering["mpo"]) * ROUNDS / 2)
    summary = results["summary"]
    assert summary["minority_cluster"] == 0 and summary["silos_evaluated"] == 8
    assert summary["mean_accuracy"] > 0.2  # well above chance (0.1) after 8 DP rounds
    with (out / "rounds.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == ROUNDS
    progress = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert progress[0]["event"] == "start" and progress[-1]["event"] == "done"
    # a round that evaluates says how long its evaluation took after its training
    evaluated = {r["round"]: r["evaluate_seconds"] for r in progress if r["event"] == "round"}
    assert evaluated[ROUNDS] > 0 and all(evaluated[r] == 0 for r in range(1, ROUNDS)
                                          if not results["rounds"][r - 1]["mean_test_accuracy"])
    assert sorted(p.name for p in (out / "models").iterdir()) == [
        f"cluster-{m}.pt" for m in range(clustering["n_clusters"])]
    for figure in ("accuracy.png", "projection.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_exhausted_silo_refuses_and_the_run_goes_on(simulated):
    out, results, spent_before = simulated
    clients = {c["partition"]: c for c in results["clients"]}
    refusing = clients[EXHAUSTED]
    assert refusing["exhausted"] is True and refusing["refused_rounds"] == [1]
    assert refusing["epsilon_spent"] == pytest.approx(spent_before)
    assert refusing["test_accuracy"] is not None  # still evaluated, which costs no budget
    assert results["rounds"][0]["refused"] == [EXHAUSTED]
    assert all(r["trained"] == 7 for r in results["rounds"])
    ledger = PrivacyLedger.load(out / "ledgers" / f"silo-{EXHAUSTED}.json")
    assert len(ledger.entries) == 1  # nothing was charged or run


@pytest.mark.slow
def test_no_silo_ever_reports_more_epsilon_than_its_budget(simulated):
    out, results, _ = simulated
    for client in results["clients"]:
        assert client["epsilon_spent"] <= client["epsilon_budget"]
        ledger = PrivacyLedger.load(out / "ledgers" / f"silo-{client['partition']}.json")
        assert ledger.spent(PrivacyBudget(10.0, 1e-4)) == pytest.approx(client["epsilon_spent"])
        assert ledger.spent(PrivacyBudget(10.0, 1e-4)) <= 10.0
    for row in results["rounds"]:
        assert row["max_epsilon_spent"] <= 10.0


def test_bad_run_config_stops_simulate_with_one_line(tmp_path):
    for override, expected in (("epsilonn=3", "unknown key 'epsilonn'"),
                               ("epsilon=-1", "'epsilon' = -1 is invalid")):
        bad = subprocess.run(
            [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--set", override,
             "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], bad.stderr


@pytest.mark.slow
def test_report_reads_a_results_directory_back(simulated, tmp_path):
    out, results, _ = simulated
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "results.json").write_text((out / "results.json").read_text())
    shown = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "report", str(copy)],
                           capture_output=True, text=True, timeout=120, check=True,
                           env={**os.environ, "COLUMNS": "150"}).stdout
    assert f"{100 * results['summary']['mean_accuracy']:.1f}%" in shown
    assert shown.count("│") > 8 * 7  # a row per silo
    assert (copy / "accuracy.png").exists() and (copy / "projection.png").exists()
