"""Flower's commands from this Python's environment: a silo or server started as
``.venv/bin/dpcfl`` must run the same flwr version without the venv being activated. Imports
nothing of the package, so every deploy module may use it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def use_this_environment() -> None:
    """Put this Python's bin directory first on PATH: Flower's SuperLink and SuperNode start
    their helpers (flwr-serverapp, flower-superexec, flwr-clientapp) by name."""
    bin_dir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if parts[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *parts])


def flower_tool(name: str) -> str | None:
    """Flower's command ``name`` from this Python's environment (else from PATH): a silo
    started as .venv/bin/dpcfl must use the same flwr version without activating the venv."""
    sibling = Path(sys.executable).parent / name
    if sibling.is_file():
        return str(sibling)
    return shutil.which(name)


__all__ = ["flower_tool", "use_this_environment"]
