"""Where a silo keeps its models: one file per run beside its ledger
(:mod:`.kept_model` writes and reads them).

Apart from :mod:`.kept_model` because naming the files needs no torch: the silo supervisor
(``dpcfl client``) shows the pattern in its plan and lists the files a run wrote without
importing it.
"""

from __future__ import annotations

from pathlib import Path

SUFFIX = ".model.pt"


def _stem(ledger_path: str | Path) -> str:
    name = Path(ledger_path).name
    return name.removesuffix(".json")


def model_path(ledger_path: str | Path, run_id: int | str) -> Path:
    """Where a silo with this ledger keeps the model of run ``run_id`` (its run key, the same
    across a resumed run, else Flower's run id)."""
    ledger = Path(ledger_path)
    return ledger.with_name(f"{_stem(ledger)}.run-{run_id}{SUFFIX}")


def model_files(ledger_path: str | Path) -> list[Path]:
    """Every run's model file of the silo with this ledger, oldest first."""
    ledger = Path(ledger_path)
    if not ledger.parent.is_dir():
        return []
    found = ledger.parent.glob(f"{_stem(ledger)}.run-*{SUFFIX}")
    return sorted(found, key=lambda path: path.stat().st_mtime)
