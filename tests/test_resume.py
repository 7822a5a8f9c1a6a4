"""A simulation killed mid-run and resumed: the same decisions as an uninterrupted run.

Both runs fix the silos' DP noise (``noise-seed``, simulation only), so round 1 gives both the
same updates: the clustering, E_c and every soft-stage assignment must be equal, and the
accuracy close. The process is killed with SIGKILL (with the Ray processes under it) once a
round after the clustering has been checkpointed; ``dpcfl simulate --resume`` then finishes
it. The silos' ledgers carry the replayed round: no silo may end above its budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcfl_flwr.privacy.ledger import PrivacyBudget, PrivacyLedger
from dpcfl_flwr.runs.processes import descendants
from dpcfl_flwr.strategies.checkpoint import CHECKPOINT, read_checkpoint

ROUNDS = 6
CONFIG = f"""clusters = "2,3,3"
samples-per-client = 200
test-samples = 100
num-server-rounds = {ROUNDS}
eval-every = 3
epsilon = 10.0
noise-seed = 7

[rdpcfl]
n-clusters = 3
select-window = 0.34
"""
KILL_AFTER = 2  # the round-1 clustering and one soft round are checkpointed


class Run:
    """A ``dpcfl simulate`` process whose output goes to a file (a pipe nobody reads while it
    runs would fill and stop it)."""

    def __init__(self, log: Path, *args: str, wait: bool = True) -> None:
        self.log = log
        with log.open("w") as handle:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--quiet", *args],
                stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                env={**os.environ, "COLUMNS": "200"})
        if wait:
            self.process.wait(timeout=600)

    @property
    def output(self) -> str:
        return self.log.read_text()


def _kill_after_round(run: Run, out: Path, done: int) -> int:
    """SIGKILL ``run`` and everything under it once round ``done`` is checkpointed; returns
    the round the checkpoint holds."""
    process = run.process
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, run.output
        path = out / CHECKPOINT
        try:
            if path.exists() and read_checkpoint(path).round >= done:
                break
        except Exception:  # noqa: BLE001 - replaced while read: try again
            pass
        time.sleep(0.05)
    tree = descendants(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)
    return read_checkpoint(out / CHECKPOINT).round


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    config = root / "run.toml"
    config.write_text(CONFIG)
    whole = Run(root / "whole.log", "--config", str(config), "--out", str(root / "whole"))
    assert whole.process.returncode == 0, whole.output
    killed = Run(root / "killed.log", "--config", str(config), "--out", str(root / "resumed"),
                 wait=False)
    checkpointed = _kill_after_round(killed, root / "resumed", KILL_AFTER)
    resumed = Run(root / "resumed.log", "--resume", str(root / "resumed"))
    assert resumed.process.returncode == 0, resumed.output
    load = lambda name: json.loads((root / name / "results.json").read_text())  # noqa: E731
    return root, config, load("whole"), load("resumed"), checkpointed


@pytest.mark.slow
def test_a_resumed_run_makes_the_decisions_of_an_uninterrupted_one(runs):
    _, _, whole, resumed, checkpointed = runs
    assert KILL_AFTER <= checkpointed < ROUNDS
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == list(
        range(1, ROUNDS + 1))
    for key in ("labels", "mss", "mpo", "switch_round", "select_rounds", "responsibilities"):
        assert resumed["clustering"][key] == whole["clustering"][key], key
    switch = whole["clustering"]["switch_round"]
    for before, after in zip(whole["rounds"], resumed["rounds"], strict=True):
        assert before["stage"] == after["stage"]
        if after["round"] <= switch:  # soft assignments: seeded draws from the same pi
            assert before["cluster_sizes"] == after["cluster_sizes"], after["round"]
    assert abs(resumed["summary"]["mean_accuracy"] - whole["summary"]["mean_accuracy"]) < 0.1


@pytest.mark.slow
def test_every_silo_stays_within_its_budget_across_the_resume(runs):
    root, _, _, resumed, _ = runs
    budget = PrivacyBudget(10.0, 1e-4)
    for client in resumed["clients"]:
        ledger = PrivacyLedger.load(root / "resumed" / "ledgers" /
                                    f"silo-{client['partition']}.json")
        assert ledger.spent(budget) <= 10.0
        assert client["epsilon_spent"] == pytest.approx(ledger.spent(budget))
        # one plan for the whole run, kept across the two Flower runs by the run key
        assert len(ledger.meta["runs"]) == 1
    # what a silo spent before the kill is this run's, not an earlier run's
    log = " ".join((root / "resumed.log").read_text().split())
    assert "already spent" not in log
    assert log.count("is back for the resumed run") == len(resumed["clients"])


@pytest.mark.slow
def test_a_finished_run_is_not_resumed_and_another_config_is_refused(runs):
    root, _, _, _, _ = runs
    again = Run(root / "again.log", "--resume", str(root / "whole"))
    assert again.process.returncode == 0
    assert "the run completed" in again.output
    (root / "whole" / "results.json").unlink()  # as if it had died after its last round
    other = Run(root / "other.log", "--resume", str(root / "whole"), "--set", "epsilon=5")
    text = other.output
    assert other.process.returncode == 2
    assert "another run config (epsilon = 10.0 there, 5.0 here)" in " ".join(text.split())
