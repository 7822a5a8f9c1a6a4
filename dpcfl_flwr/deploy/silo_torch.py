"""What ``dpcfl client`` needs torch (or the accountants) for, done in a short-lived process of
its own.

The silo supervisor lives as long as its silo but never trains (its SuperNode does). It needs
torch at its start, to check the silo's records (and the federation's schema, whose model is
loaded to validate it) before it joins and to ask CUDA about the silo's device, and at its end,
to read the model files a run left. Torch, once imported, stays in the process: some 300 MB
resident for each silo on a host, for nothing. The same holds, smaller, for the privacy
accountants it needs once, to say what the silo's ledger already spent: dp-accounting and the
SciPy it loads are ~55 MB resident. So each of the two moments runs one child,
``python -m dpcfl_flwr.deploy.silo_torch {start SETTINGS_JSON | models PATH...}``, which says
what the supervisor shows and exits, its memory returned: one child for all the start's
questions, since each child pays torch's import again (1-3 s of CPU on a busy host, times the
silos that start together).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config.settings import SiloConfig

_MODULE = "dpcfl_flwr.deploy.silo_torch"


@dataclass(frozen=True)
class SiloInspection:
    """What a silo's start learns from its child.

    ``problems``: why the silo could not build its records (its schema file unreadable, a
    missing or damaged data file, records that do not fit the schema: one line each,
    :func:`dpcfl_flwr.silo.silo.records_problem`) or use its CUDA device; empty: it can.
    ``ledger``: what its ledger already holds (earlier runs' spend is not available to this
    one), measured by the silo's own accountant, or why it was not measured."""

    problems: list[str]
    ledger: str


def inspect_silo(settings: SiloConfig) -> SiloInspection:
    """Ask one child about the silo with these deployed (resolved) settings. Records are
    checked only when the data directory, if any, exists (a missing one is said by the
    supervisor's own checks); the device only when it is a CUDA device."""
    done = subprocess.run(_command("start", json.dumps(settings.model_dump(
        mode="json", by_alias=True))), stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode == 0:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            found = json.loads(done.stdout)
            return SiloInspection([str(line) for line in found["problems"]],
                                  str(found["ledger"]))
    failed = f"the check failed (exit code {done.returncode}; its error is above)"
    return SiloInspection([f"the silo's records and device: {failed}"],
                          f"not measured: {failed}")


def print_models(paths: list[Path]) -> None:
    """One line per model file (which model of which run, how good, what it cost), printed
    by a child, or why a file cannot be read."""
    sys.stdout.flush()
    subprocess.run(_command("models", *(str(path) for path in paths)), check=False)


def _ledger_line(node: SiloConfig) -> str:
    from ..privacy.defaults import DEFAULT_ACCOUNTANT
    from ..privacy.ledger import PrivacyBudget, PrivacyLedger

    assert node.epsilon is not None and node.delta is not None  # resolved
    try:
        ledger = PrivacyLedger.load(node.ledger_path)
    except ValueError as exc:
        return f"unreadable: {exc}"
    if not ledger.entries:
        return "new: nothing spent yet"
    spent = ledger.spent(PrivacyBudget(node.epsilon, node.delta,
                                       accountant=node.accountant or DEFAULT_ACCOUNTANT))
    return (f"epsilon {spent:.4g} of {node.epsilon:g} already spent in earlier runs, "
            f"{max(node.epsilon - spent, 0.0):.4g} left for the next")


def _command(*args: str) -> list[str]:
    # -P: the child imports dpcfl_flwr as the supervisor's SuperNode does, never from the
    # working directory (silo_file.supernode_command)
    return [sys.executable, "-P", "-m", _MODULE, *args]


def _start_answers(settings_json: str) -> str:
    """The child's answer at a silo's start: a JSON object of its problems and ledger line."""
    settings = SiloConfig.model_validate(json.loads(settings_json))
    problems = []
    if not settings.data_dir or Path(settings.data_dir).is_dir():
        problems += _records_check(settings)
    if settings.device.startswith("cuda"):
        problems += _device_check(settings.device)
    return json.dumps({"problems": problems, "ledger": _ledger_line(settings)})


def _records_check(settings: SiloConfig) -> list[str]:
    """Why the silo's records fail under its pinned schema (the one every run of it must
    use, :mod:`dpcfl_flwr.silo.schema_pin`), in full: this is the operator's terminal."""
    from ..config.validation import ConfigError
    from ..silo.schema_pin import pinned_schema
    from ..silo.silo import records_problem

    try:
        schema = pinned_schema(settings)
    except ConfigError as exc:
        return [str(exc)]
    return [problem for problem in [records_problem(settings, schema)] if problem]


def _device_check(device: str) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return [f"device {device}: CUDA is not available on this machine"]
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return [f"device {device}: only {torch.cuda.device_count()} GPU(s) here"]
    return []


def _describe_models(paths: list[str]) -> None:
    from ..silo.kept_model import describe, read_metadata
    from .supervision import console

    for path in paths:
        try:
            line = describe(path, read_metadata(path))
        except ValueError as exc:
            line = str(exc)
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def main(argv: list[str]) -> int:
    """The child: ``start SETTINGS_JSON`` or ``models PATH...``."""
    what, *args = argv
    if what == "models":
        _describe_models(args)
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answer alone
        answer = _start_answers(*args)
    sys.stdout.write(answer + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
