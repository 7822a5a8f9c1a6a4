"""A simulation on stock Flower: the public ``flwr.simulation.run_simulation`` only.

Used when the version gate of :mod:`dpcfl_flwr.flower_compat` is closed (another Flower
release, or ``DPCFL_FLOWER_TUNING=0``). Flower's public entry point takes app objects and no
run config (its contexts carry an empty one), so each app is wrapped in a public app of the
same kind that puts the run config into the context before handing the call on: the apps
see exactly what ``flwr run`` would give them. Rounds cost more than on the tuned path (the
engine's 0.1 s dispatch period, Ray's object store for messages above 100 KB), results do
not change.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

logger = logging.getLogger(__name__)


def load_app(reference: str) -> Any:
    """The object a ``"module:attr"`` reference names (e.g. ``dpcfl_flwr.server_app:app``)."""
    module, _, attr = reference.partition(":")
    if not attr:
        raise ValueError(f"expected an app reference module:attr, got {reference!r}")
    return getattr(importlib.import_module(module), attr)


def server_app_with(app: ServerApp, run_config: Mapping[str, Any]) -> ServerApp:
    """A ServerApp that runs ``app`` with ``run_config`` in its context."""
    wrapped = ServerApp()

    @wrapped.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = dict(run_config)
        app(grid, context)

    return wrapped


def client_app_with(app: ClientApp, run_config: Mapping[str, Any]) -> ClientApp:
    """A ClientApp that hands every train, evaluate and query message to ``app`` with
    ``run_config`` in its context (for that call: the node's own is put back after it)."""
    wrapped = ClientApp()

    def handle(message: Message, context: Context) -> Message:
        # Flower checks after each call that the node's run config was left as it was.
        flowers = context.run_config
        context.run_config = {**flowers, **run_config}
        try:
            return app(message, context)
        finally:
            context.run_config = flowers

    wrapped.train()(handle)
    wrapped.evaluate()(handle)
    wrapped.query()(handle)
    return wrapped


def run_stock_simulation(*, num_supernodes: int, server_app: str, client_app: str,
                         run_config: Mapping[str, Any], backend_config: dict[str, Any],
                         verbose: bool) -> None:
    """Run the referenced apps through Flower's public simulation entry point."""
    run_simulation(server_app=server_app_with(load_app(server_app), run_config),
                   client_app=client_app_with(load_app(client_app), run_config),
                   num_supernodes=num_supernodes, backend_name="ray",
                   backend_config=backend_config, verbose_logging=verbose)


__all__ = ["client_app_with", "load_app", "run_stock_simulation", "server_app_with"]
