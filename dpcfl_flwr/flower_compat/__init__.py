"""The one place that reaches into Flower's non-public modules, behind one version gate.

Everything of Flower this package uses beyond its public API (``flwr.app``, ``flwr.serverapp``,
``flwr.clientapp``, ``flwr.simulation.run_simulation``) lives in the submodules of this
package: the simulation engine's latency tuning (:mod:`.engine`; :mod:`.stock` is the same run
on public Flower only), the SuperNode's and the SuperLink's patches (:mod:`.supernode`,
:mod:`.superlink`, :mod:`.control_middleware`, :mod:`.runtime_fast_path`), the ServerApp's
object batches (:mod:`.object_batches`) and the silo's
ClientApp runtimes that enforce the app pin (:mod:`.direct_runtime`, :mod:`.warm_runtime`).
The rest of ``dpcfl_flwr`` calls only the functions of this file, which import a submodule
only after the gate said yes (and a silo's launcher, ``deploy/supernode_launcher.py``, calls
:func:`.supernode.run_supernode` once :func:`pin_supported` said yes). What each one changes
and what a closed gate gives up: docs/deployment.md#flower-internals-one-package-one-gate.

The gate (:mod:`.gate`) is decided once per process, before any internal import: the installed
Flower must be :data:`~.gate.SUPPORTED_FLOWER` and the operator must not have switched the
tuning off (``DPCFL_FLOWER_TUNING=0``); otherwise one warning line says so and the app runs on
stock Flower: a simulation goes through the public ``flwr.simulation.run_simulation`` and
polls at a fixed period.

Only latency is ever given up this way. The SuperNode's app pin (a silo refuses a FAB whose
code is not the installed one) needs Flower's SuperNode internals too; it is not tuning, so
on another Flower release the silo launcher refuses to start instead of running unpinned.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

from . import gate
from .gate import (
    FALLBACK_ARRAY_CHUNK_BYTES,
    IN_MEMORY_DATABASE,
    KEY_NOT_REGISTERED,
    NODE_ONLINE,
    SUPPORTED_FLOWER,
    SWITCH,
    installed_flower,
    pin_supported,
    require_pin,
)


def in_process_grid(grid: Any) -> bool:
    """Whether ``grid`` is the simulation engine's in-memory grid (the ServerApp shares its
    process with the engine, so a poll costs next to nothing), not a deployment's."""
    if gate.TUNING:
        from .engine import is_in_memory_grid

        return is_in_memory_grid(grid)
    return type(grid).__name__ == "InMemoryGrid"


def replies_wake_waits(grid: Any) -> bool:
    """Whether :func:`wait_for_replies` on ``grid`` ends as soon as a reply is stored: a
    simulation's grid with the tuning on. Then a poller needs no timer to learn of a reply."""
    if gate.TUNING:
        from .engine import replies_wake_waits as woken

        return woken(grid)
    return False


def batch_object_requests(grid: Any) -> bool:
    """With the tuning on, let a deployment's grid (the ServerApp's, over the SuperLink's
    Runtime API) move its message objects in batches (:mod:`.object_batches`); whether it
    does. A simulation's in-process grid moves no objects over HTTP."""
    if not gate.TUNING or in_process_grid(grid):
        return False
    from . import object_batches

    object_batches.install()
    return True


def wait_for_replies(grid: Any, seconds: float) -> None:
    """Wait ``seconds`` (>= 0) for replies on ``grid``; with the tuning on, a simulation's
    wait ends as soon as the engine stores a reply. Without it: a plain sleep."""
    if gate.TUNING:
        from .engine import wait_for_replies as woken_wait

        woken_wait(grid, seconds)
        return
    time.sleep(seconds)


@cache
def array_chunk_size() -> int:
    """The largest array chunk Flower sends in one piece, in bytes: a model up to this size
    travels as plain bytes (``protocol.pack``). Flower's own constant with the tuning on; with
    the gate closed the same formula as Flower 1.39's (:data:`FALLBACK_ARRAY_CHUNK_BYTES`)."""
    if gate.TUNING:
        from .engine import flower_array_chunk_size

        return flower_array_chunk_size()
    return int(os.getenv("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", str(FALLBACK_ARRAY_CHUNK_BYTES)))


@contextlib.contextmanager
def signals_left_to_caller() -> Iterator[None]:
    """While the block runs, ``ray.init`` leaves this process's SIGTERM handler alone (tuning
    on); without the tuning Ray installs its own, and only Ctrl-C stops a simulation cleanly."""
    if not gate.TUNING:
        yield
        return
    from .engine import signals_left_to_us

    with signals_left_to_us():
        yield


def run_simulation(*, num_supernodes: int, server_app: str, client_app: str,
                   run_config: Mapping[str, Any], backend_config: dict[str, Any],
                   app_dir: str, verbose: bool) -> None:
    """Run the apps (``"module:attr"`` references) in Flower's simulation engine, one virtual
    SuperNode each of ``num_supernodes``, every app seeing ``run_config`` in its context.

    ``app_dir`` is an app directory whose ``pyproject.toml`` holds the run config; the tuned
    path runs it through Flower's runtime with the woken dispatcher and Ray's inline
    messages, the stock path hands the apps to ``flwr.simulation.run_simulation``."""
    if gate.TUNING:
        from .engine import run_tuned_simulation

        run_tuned_simulation(num_supernodes=num_supernodes, server_app=server_app,
                             client_app=client_app, run_config=run_config,
                             backend_config=backend_config, app_dir=app_dir, verbose=verbose)
        return
    from .stock import run_stock_simulation

    run_stock_simulation(num_supernodes=num_supernodes, server_app=server_app,
                         client_app=client_app, run_config=run_config,
                         backend_config=backend_config, verbose=verbose)


def run_superlink(flower_arguments: Sequence[str], pull_hold: float) -> None:
    """Run ``flower-superlink <flower_arguments>`` in this process: with the tuning on,
    holding an empty SuperNode poll up to ``pull_hold`` seconds (:mod:`.superlink`); without
    it, stock Flower (its ``flower-superlink`` console script). Returns or raises SystemExit
    as Flower's SuperLink does."""
    if gate.TUNING:
        from .superlink import run_superlink as run_tuned_superlink

        run_tuned_superlink(flower_arguments, pull_hold)
        return
    print("dpcfl: stock flower-superlink (Flower tuning off): SuperNode polls are answered "
          "at once", file=sys.stderr, flush=True)
    sys.argv = ["flower-superlink", *flower_arguments]
    flower_command("flower-superlink")()


def register_node_keys(flwr_home: Path, connection: str, keys: Sequence[Path]
                       ) -> list[tuple[bool, str | None]] | None:
    """Register silo public keys with the SuperLink of ``connection`` (in ``flwr_home``'s
    Flower configuration) through one client in this process (:mod:`.registration`): per key,
    (registered, Flower's refusal in one line). None with the gate closed: the caller then
    runs Flower's public ``flwr supernode register`` once per key, only slower."""
    if not gate.TUNING:
        return None
    from .registration import register_keys

    return register_keys(flwr_home, connection, keys)


def flower_command(name: str) -> Callable[[], object]:
    """The function behind Flower's console script ``name`` (its public command line)."""
    found = importlib.metadata.entry_points(group="console_scripts", name=name)
    if not found:
        raise RuntimeError(f"the installed Flower has no command {name}")
    return cast(Callable[[], object], next(iter(found)).load())


__all__ = ["FALLBACK_ARRAY_CHUNK_BYTES", "IN_MEMORY_DATABASE", "KEY_NOT_REGISTERED",
           "NODE_ONLINE", "SUPPORTED_FLOWER", "SWITCH", "array_chunk_size",
           "batch_object_requests",
           "flower_command", "in_process_grid", "installed_flower", "pin_supported", "require_pin",
           "replies_wake_waits", "run_simulation", "run_superlink", "signals_left_to_caller",
           "wait_for_replies"]
