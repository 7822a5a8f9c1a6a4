"""The ``dpcfl`` command as a user runs it: a real process, its output and exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DPCFL = [sys.executable, "-m", "dpcfl_flwr.cli"]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run([*DPCFL, *args], capture_output=True, text=True, timeout=600, env=env,
                          check=check)


def test_noise_command_prints_the_spec_table_value():
    # spec §3: FMNIST N=8000, eps_train = 3.5040 (eps_total = 5) -> R-DPCFL z = 1.85.
    out = _run("privacy", "noise", "--samples", "8000", "--batch", "32", "--first-batch", "full",
               "--epsilon", "3.5040", "--delta", "1e-4", "--rounds", "200", "--epochs", "1",
               "--conversion", "classic").stdout
    z = float(re.search(r"noise multiplier z\s*│\s*([0-9.]+)", out).group(1))
    assert z == pytest.approx(1.85, abs=0.01)


def test_noise_command_json_with_selection_budget():
    out = _run("privacy", "noise", "--samples", "8000", "--batch", "32", "--epsilon", "5",
               "--rounds", "200", "--select-rounds", "20", "--select-ratio", "0.03",
               "--json").stdout
    result = json.loads(out)
    assert result["split"]["epsilon_train"] == pytest.approx(3.5040, abs=1e-3)
    assert result["split"]["epsilon_clustering"] == pytest.approx(1.4960, abs=1e-3)
    assert result["noise_multiplier"] == pytest.approx(1.85, abs=0.01)
    assert result["noise_multiplier_2dp_up"] >= result["noise_multiplier"]


def test_noise_command_errors_are_one_line_and_exit_2():
    bad = _run("privacy", "noise", "--samples", "100", "--batch", "320", "--epsilon", "5",
               "--rounds", "10", check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: batch size 320 exceeds the 100 samples"


def test_probe_with_a_bad_data_directory_gives_one_line(tmp_path: Path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    bad = _run("probe", "--dataset", "mnist", "--data-dir", str(tmp_path), "--samples", "10",
               "--out", str(tmp_path / "out"), check=False)
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in bad.stdout + bad.stderr
