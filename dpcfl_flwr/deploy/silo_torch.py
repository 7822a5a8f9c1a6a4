"""What ``dpcfl client`` needs torch (or the accountants) for, each done in a short-lived
process of its own.

The silo supervisor lives as long as its silo but never trains (its SuperNode does). It needs
torch three times: to check the silo's records (and the federation's schema, whose model is
loaded to validate it) before it joins, to ask CUDA about the silo's device, and to read the
model files a run left. Torch, once imported, stays in the process: some 300 MB resident for
each silo on a host, for nothing. The same holds, smaller, for the privacy accountants it
needs once, to say what the silo's ledger already spent: dp-accounting and the SciPy it loads
are ~55 MB resident. So each of these runs in a child,
``python -m dpcfl_flwr.deploy.silo_torch {records|device|models|ledger} ...``, which says what
the supervisor shows and exits, its memory returned.

``records`` and ``device`` print a JSON list of problem lines (one line each, as the
supervisor's other checks); ``models`` prints one line per model file for the operator;
``ledger`` prints the ledger's state in one line.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

from ..config.settings import SiloConfig

_MODULE = "dpcfl_flwr.deploy.silo_torch"


def records_problems(settings: SiloConfig) -> list[str]:
    """Why a silo with these deployed settings could not build its records (its schema file
    unreadable, a missing or damaged data file, records that do not fit the schema: one line,
    :func:`dpcfl_flwr.silo.silo.records_problem`); empty: it can. Checked in a child."""
    return _problems("the silo's records", "records",
                     json.dumps(settings.model_dump(mode="json", by_alias=True)))


def device_problems(device: str) -> list[str]:
    """Why the silo cannot use CUDA ``device`` here (empty: it can). Checked in a child."""
    return _problems(f"device {device}", "device", device)


def print_models(paths: list[Path]) -> None:
    """One line per model file (which model of which run, how good, what it cost), printed
    by a child, or why a file cannot be read."""
    sys.stdout.flush()
    subprocess.run(_command("models", *(str(path) for path in paths)), check=False)


def ledger_summary(settings: SiloConfig) -> str:
    """What the silo's ledger already holds (earlier runs' spend is not available to this
    one), measured by the silo's own accountant in a child."""
    done = subprocess.run(_command("ledger", json.dumps(settings.model_dump(
        mode="json", by_alias=True))), stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip().splitlines()[-1]
    return f"not measured: the check failed (exit code {done.returncode}; its error is above)"


def _ledger_line(settings_json: str) -> str:
    from ..privacy.defaults import DEFAULT_ACCOUNTANT
    from ..privacy.ledger import PrivacyBudget, PrivacyLedger

    node = SiloConfig.model_validate(json.loads(settings_json))
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


def _problems(what: str, *args: str) -> list[str]:
    """The problem lines a child prints; one line saying so if the child fails (its
    traceback is on stderr, above)."""
    done = subprocess.run(_command(*args), stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode == 0:
        with contextlib.suppress(ValueError):
            found = json.loads(done.stdout)
            if isinstance(found, list):
                return [str(line) for line in found]
    return [f"{what}: the check failed (exit code {done.returncode}; its error is above)"]


def _records_check(settings_json: str) -> list[str]:
    from ..config.config_file import load_schema
    from ..config.validation import ConfigError
    from ..silo.silo import records_problem

    settings = SiloConfig.model_validate(json.loads(settings_json))
    try:
        schema = load_schema(settings.schema_file) if settings.schema_file else None
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
    """The child: ``records SETTINGS_JSON``, ``device DEVICE``, ``models PATH...`` or
    ``ledger SETTINGS_JSON``."""
    what, *args = argv
    if what == "models":
        _describe_models(args)
        return 0
    answers = {"records": lambda: json.dumps(_records_check(*args)),
               "device": lambda: json.dumps(_device_check(*args)),
               "ledger": lambda: _ledger_line(*args)}
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answer alone
        answer = answers[what]()
    sys.stdout.write(answer + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
