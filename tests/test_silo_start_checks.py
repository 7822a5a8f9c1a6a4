"""A silo that could not answer a message never starts: `dpcfl client` checks its records (its
partition in its own topology, its data files) before it connects, with one line and exit 2,
so no run waits on it or spends the other silos' budget meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DPCFL = str(Path(sys.executable).parent / "dpcfl")


def _client(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    wide = {**os.environ, "COLUMNS": "300"}  # the plan's cells on one line each
    return subprocess.run(
        [DPCFL, "client", "--name", "s", "--insecure", "--superlink", "127.0.0.1:9",
         "--runtime-port", "9", "--epsilon", "3", "--delta", "1e-5", "--ledger-path",
         str(tmp_path / "ledger.json"), "--dry-run", *flags],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=wide)


@pytest.mark.parametrize(("flags", "says"), [
    (["--partition-id", "30"], "client id 30 is out of range: topology 3,6,6,6 has clients 0..20"),
    (["--partition-id", "2", "--clusters", "1,1"], "has clients 0..1"),
    (["--partition-id", "2", "--data-dir", "{empty}"], "no Fashion-MNIST file"),
    (["--partition-id", "2", "--dataset", "mnist"], "no data directory given"),
])
def test_a_silo_whose_records_cannot_be_read_does_not_start(tmp_path, flags, says):
    (tmp_path / "empty").mkdir()
    flags = [flag.replace("{empty}", str(tmp_path / "empty")) for flag in flags]
    result = _client(tmp_path, *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the silo's records" in errors[0] and says in errors[0]
    assert "silo s" not in result.stdout  # no plan: nothing started


def test_one_child_answers_records_device_and_ledger_together(tmp_path):
    """A silo asking for a GPU on a machine without CUDA is refused in the same start as a
    partition out of range: the start's one child answers every question at once."""
    result = _client(tmp_path, "--partition-id", "30", "--device", "cuda:0")
    assert result.returncode == 2, result.stdout + result.stderr
    errors = " ".join(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert "client id 30 is out of range" in errors
    assert "device cuda:0: CUDA is not available on this machine" in errors


def test_a_silo_whose_records_are_readable_prints_its_plan(tmp_path):
    result = _client(tmp_path, "--partition-id", "2")
    assert result.returncode == 0, result.stderr
    assert "silo s" in result.stdout and "error" not in result.stderr


def test_the_plan_says_what_earlier_runs_already_spent(tmp_path):
    from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger

    ledger = PrivacyLedger()
    ledger.record([GaussianSteps(5.0, 1.0, 3, round=1)])
    ledger.save(tmp_path / "ledger.json")
    spent = ledger.spent(PrivacyBudget(3.0, 1e-5))
    result = _client(tmp_path, "--partition-id", "2")
    plan = " ".join(result.stdout.split())
    assert f"epsilon {spent:.4g} of 3 already spent in earlier runs" in plan, plan
    assert f"{3 - spent:.4g} left" in plan
