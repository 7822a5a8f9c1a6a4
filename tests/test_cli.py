"""The ``dpcfl`` command as a user runs it: a real process, its output and exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

DPCFL = [sys.executable, "-m", "dpcfl_flwr.cli"]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run([*DPCFL, *args], capture_output=True, text=True, timeout=600, env=env,
                          check=check)


def test_noise_command_prints_the_reference_table_value():
    # docs/privacy.md#reference-values: FMNIST N=8000, eps_train = 3.5040 (eps_total = 5)
    # -> R-DPCFL z = 1.85.
    out = _run("privacy", "noise", "--samples", "8000", "--batch", "32", "--first-batch", "full",
               "--epsilon", "3.5040", "--delta", "1e-4", "--rounds", "200", "--epochs", "1",
               "--conversion", "classic", "--accountant", "rdp").stdout
    z = float(re.search(r"noise multiplier z\s*│\s*([0-9.]+)", out).group(1))
    assert z == pytest.approx(1.85, abs=0.01)


def test_noise_command_json_with_selection_budget():
    # the authors' accounting, named (docs/privacy.md#reference-values)
    out = _run("privacy", "noise", "--samples", "8000", "--batch", "32", "--epsilon", "5",
               "--rounds", "200", "--select-rounds", "20", "--select-ratio", "0.03",
               "--budget-mode", "split", "--conversion", "classic", "--accountant", "rdp",
               "--json").stdout
    result = json.loads(out)
    assert result["split"]["epsilon_train"] == pytest.approx(3.5040, abs=1e-3)
    assert result["split"]["epsilon_clustering"] == pytest.approx(1.4960, abs=1e-3)
    assert result["noise_multiplier"] == pytest.approx(1.85, abs=0.01)
    assert result["noise_multiplier_2dp_up"] >= result["noise_multiplier"]


def test_noise_command_defaults_to_the_whole_budget_accounting():
    # docs/privacy.md#the-default-accounting, at the paper's scale and eps = 10: everything
    # composed and converted once (tight), PLD beside RDP; 20 selections make RDP the tighter,
    # so both give z = 0.8524 against the authors' 1.0889
    out = _run("privacy", "noise", "--samples", "8000", "--batch", "32", "--epsilon", "10",
               "--rounds", "200", "--select-rounds", "20", "--json").stdout
    result = json.loads(out)
    assert result["pld"]["split"]["mode"] == "joint"
    assert result["pld"]["split"]["conversion"] == "tight"
    assert result["pld"]["noise_multiplier"] == pytest.approx(0.8524, abs=1e-4)
    assert result["rdp"]["noise_multiplier"] == pytest.approx(0.8524, abs=1e-4)
    assert result["epsilon_at_z"]["pld"] == pytest.approx(10.0, abs=1e-6)
    assert result["authors_noise_multiplier"] == pytest.approx(1.0889, abs=1e-4)


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


def _leaf_commands() -> list[tuple[list[str], click.Command]]:
    """Every command a user runs (``dpcfl privacy noise`` ...), with its click object."""
    from dpcfl_flwr.cli import app

    found, groups = [], [([], typer.main.get_command(app))]
    while groups:
        path, group = groups.pop()
        context = click.Context(group)
        for name in group.list_commands(context):  # type: ignore[attr-defined]
            command = group.get_command(context, name)  # type: ignore[attr-defined]
            if isinstance(command, click.Group):
                groups.append(([*path, name], command))
            else:
                found.append(([*path, name], command))
    return sorted(found, key=lambda item: item[0])


def _option_entries(help_text: str) -> dict[str, str]:
    """The Options section of a plain help: the names column of each entry -> its text,
    wrapped lines joined, without the ``[default: ...]`` / range / required notes."""
    section = help_text.split("\nOptions:\n", 1)[1]
    entries: list[list[str]] = []
    for line in section.splitlines():
        if line.startswith("  -"):
            names, _, text = line.strip().partition("  ")
            entries.append([names.strip(), text.strip()])
        elif line.startswith("   ") and entries:
            entries[-1][1] = f"{entries[-1][1]} {line.strip()}".strip()
    return {names: re.sub(r"(\s*\[[^\]]*\])+$", "", text).strip() for names, text in entries}


# Commands of other modules whose every option is not described yet (checked for cut names).
@pytest.mark.parametrize(("path", "command"), _leaf_commands(),
                         ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_help_fits_80_columns_with_every_option_named_in_full_and_described(path, command):
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}
    shown = subprocess.run([*DPCFL, *path, "--help"], capture_output=True, text=True,
                           env=env, timeout=120, check=True).stdout
    assert "…" not in shown and "\\[" not in shown, shown
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    entries = _option_entries(shown)
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    for option in options:
        names = [*option.opts, *option.secondary_opts]
        entry = [key for key in entries if set(names) <= set(re.findall(r"-[-\w]+", key))]
        assert len(entry) == 1, f"{' '.join(path)}: {names} not shown in full:\n{shown}"
        assert entries[entry[0]], f"{' '.join(path)} {names[0]} has no description"
    assert len(entries) == len(options) + 1  # and --help


def test_version_names_this_package_and_flower():
    from importlib import metadata

    shown = _run("--version").stdout.strip()
    assert shown.startswith(f"dpcfl-flwr {metadata.version('dpcfl-flwr')} (flwr 1.39.0")


def test_superlink_help_says_which_port_each_command_dials():
    submit, client = (" ".join(_run(command, "--help").stdout.split())
                      for command in ("submit", "client"))
    assert "control API" in submit and "8000" in submit and "9092" in submit
    assert "Fleet API" in client and "9092" in client and "8000" in client


@pytest.mark.parametrize("command", [
    ["simulate", "--out", "{tmp}/out"],
    ["submit", "--superlink", "127.0.0.1:1", "--insecure"],
])
def test_a_topology_too_small_for_the_method_is_one_line_before_anything_starts(tmp_path,
                                                                               command):
    """R-DPCFL with M = 4 needs 5 silos: three silos are refused by the run config itself, so
    neither a simulation nor a SuperLink ever starts the run (it used to stop at the
    server's start, after the silos had connected)."""
    args = [part.replace("{tmp}", str(tmp_path)) for part in command]
    bad = _run(*args, "--set", 'clusters="3"', "--set", "rdpcfl.n-clusters=4", check=False)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, bad.stderr
    assert "method rdpcfl, n-clusters = 4 needs at least 5 silos" in lines[0]
    assert "clusters = '3' has 3" in lines[0]
    assert not (tmp_path / "out").exists()
