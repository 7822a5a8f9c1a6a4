"""Flower's version gate: whether this package may reach into Flower's internals, decided once
per process when this module is first imported (flower_compat/__init__.py says what it
guards and what a closed gate gives up).

- :data:`SUPPORTED_FLOWER` is the Flower release every patch and private import was written
  against and tested on; the installed release is read from the package metadata
  (``importlib.metadata.version("flwr")``), not from Flower's own modules.
- :data:`TUNING` is true when the two match and the operator did not switch the tuning off
  with the environment variable ``DPCFL_FLOWER_TUNING=0`` (:data:`SWITCH`).
- Otherwise one warning line (logger ``dpcfl_flwr``, once per process) says the tuning is
  skipped, nothing internal is imported, and the app runs on stock Flower.

The submodules of ``flower_compat`` read :data:`TUNING` here (``gate.TUNING`` at call time,
so a test may switch it), and the package's ``__init__`` hands the gate's names on: no module
of the package imports its ``__init__``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

logger = logging.getLogger("dpcfl_flwr")

#: The Flower release the private imports and patches of this package are written for.
SUPPORTED_FLOWER = "1.39.0"
#: Set to ``0`` to run on stock Flower even on :data:`SUPPORTED_FLOWER` (e.g. to compare).
SWITCH = "DPCFL_FLOWER_TUNING"
#: Flower 1.39's largest array chunk in bytes (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``: 5 MiB,
#: overridden by the environment variable of that name), used while the gate is closed.
FALLBACK_ARRAY_CHUNK_BYTES = 5 * 2**20
#: ``flower-superlink --database`` for a state kept in memory (Flower 1.39's CLI value).
IN_MEMORY_DATABASE = ":flwr-in-memory:"
#: Said to a SuperNode whose activation is refused (Flower's own answer is only "Failed to
#: activate SuperNode." in both cases, the reason only in the SuperLink's log; see
#: :mod:`.superlink`). A silo's supervisor reads these words (``dpcfl client``): keep them.
KEY_NOT_REGISTERED = "this SuperNode's public key is not registered with the SuperLink"
NODE_ONLINE = "a SuperNode with this public key is online"


def installed_flower() -> str | None:
    """The installed Flower release from its package metadata; None if it is not installed."""
    try:
        return importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:
        return None


def pin_supported() -> bool:
    """Whether the installed Flower is the one whose SuperNode internals the app pin uses.
    Not switched off by :data:`SWITCH`: without the pin a silo does not start at all."""
    return installed_flower() == SUPPORTED_FLOWER


def require_pin(module: str) -> None:
    """Raise ImportError in ``module`` (a runtime of the app pin) unless :func:`pin_supported`:
    its imports of Flower's internals would fail, or worse, bind to other behaviour."""
    if not pin_supported():
        raise ImportError(f"{module} is written for flwr {SUPPORTED_FLOWER}'s internals, "
                          f"not {installed_flower()}")


def _gate() -> bool:
    """Whether the tuning is on; logs one line when it is not."""
    if os.environ.get(SWITCH, "1").strip() == "0":
        logger.warning("Flower tuning switched off (%s=0): the app runs on stock Flower", SWITCH)
        return False
    installed = installed_flower()
    if installed != SUPPORTED_FLOWER:
        logger.warning("Flower %s is installed, the tuning is written for %s: it is skipped "
                       "and the app runs on stock Flower", installed, SUPPORTED_FLOWER)
        return False
    return True


#: True when the internal tuning is used (see the module's docstring).
TUNING = _gate()
