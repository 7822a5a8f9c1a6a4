"""``flower-supernode`` that runs only the installed app, with shorter waits between polls.

What a silo's process runs (``dpcfl client`` starts it; :mod:`.silo_file` builds the command):

  python -m dpcfl_flwr.deploy.supernode_launcher [--clientapp warm|per-message]
      [--idle-poll 0.5] <flower-supernode arguments>

It starts Flower's own SuperNode through :mod:`dpcfl_flwr.flower_compat.supernode`, where
every reach into Flower's internals lives: the SuperNode answers its ClientApp tasks from its
own process, for FABs that ship the app installed on the silo only (the app pin,
:mod:`dpcfl_flwr.app_pin`): ``--clientapp warm`` (the default) with one ClientApp loaded in
the process, ``--clientapp per-message`` with a fresh ``flwr-clientapp`` per trusted task.
Flower's SuperExec, which would run any FAB's code, is never started (the SuperNode runs with
``--isolation process``; ``--isolation subprocess`` and runtime dependency installation are
refused). While the gate of :mod:`dpcfl_flwr.flower_compat` is open, an idle silo polls every
``--idle-poll`` seconds (Flower's: 3 s), its reply leaves as soon as the ClientApp is done,
and a silo restarted after a crash rejoins at once.

The pin needs Flower's SuperNode internals, so on a Flower release other than
``flower_compat.SUPPORTED_FLOWER`` this launcher refuses to start (exit status 2) instead of
running a silo that would run any FAB; ``DPCFL_FLOWER_TUNING=0`` gives up the latency tuning
only, never the pin.

When the SuperNode has finished (Flower's graceful exit on SIGTERM included), the launcher
ends the process with ``os._exit``: when the SuperLink went away at the same moment, a gRPC
channel's finaliser could block the interpreter's shutdown for good (seen here: orphaned
SuperNodes stuck in ``Channel.__del__`` after a deployment was torn down, and Flower's own
force-exit thread cannot run once the interpreter is finalising).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ..flower_compat import SUPPORTED_FLOWER, installed_flower, pin_supported
from ..runs.processes import exit_code_of

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

DEFAULT_IDLE_POLL = 0.5  # seconds between an idle silo's polls


def split_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our options: --idle-poll, --clientapp; the rest, in order, for flower-supernode)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--idle-poll", type=float, default=DEFAULT_IDLE_POLL)
    parser.add_argument("--clientapp", choices=("warm", "per-message"), default="warm")
    return parser.parse_known_args(list(argv))


def unpinned_options(flower_arguments: Sequence[str]) -> list[str]:
    """The ``flower-supernode`` options that would let code other than the installed app run
    (Flower's SuperExec runs any FAB; dependency installation runs any package's build)."""
    found = [argument for argument in flower_arguments
             if argument.startswith("--allow-runtime-dependency-installation")]
    for i, argument in enumerate(flower_arguments):
        value = (argument.partition("=")[2] if argument.startswith("--isolation=") else
                 flower_arguments[i + 1] if argument == "--isolation"
                 and i + 1 < len(flower_arguments) else None)
        if value is not None and value != "process":
            found.append(f"--isolation {value}")
    return found


def main(argv: Sequence[str] | None = None) -> None:
    options, rest = split_arguments(sys.argv[1:] if argv is None else argv)
    if not pin_supported():
        _refuse(f"the app pin needs flwr {SUPPORTED_FLOWER}'s SuperNode, "
                f"not {installed_flower()}")
    if unpinned := unpinned_options(rest):
        _refuse(f"{', '.join(unpinned)} would run code other than the installed app")
    from ..flower_compat.supernode import run_supernode

    _show_our_logs()
    code = exit_code_of(lambda: run_supernode(rest, options.idle_poll,
                                              options.clientapp == "per-message",
                                              _load_client_app))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not the interpreter's shutdown: see the module docstring


def _refuse(reason: str) -> NoReturn:
    print(f"dpcfl: cannot start this silo: {reason}", file=sys.stderr, flush=True)
    os._exit(2)


def _show_our_logs() -> None:
    """Our modules' INFO lines (the warm ClientApp's) on stderr, next to Flower's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours = logging.getLogger("dpcfl_flwr")
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)


def _load_client_app() -> ClientApp:
    from dpcfl_flwr.client_app import app  # noqa: PLC0415 (torch, only when it is needed)
    return app


if __name__ == "__main__":
    main()
