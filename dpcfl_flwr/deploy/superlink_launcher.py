"""``flower-superlink`` that answers a poll when there is complete work for the poller.

What ``dpcfl server`` runs (:mod:`.superlink` builds the command):

  python -m dpcfl_flwr.deploy.superlink_launcher [--pull-hold 10] <flower-superlink arguments>

It starts Flower's own SuperLink through :func:`dpcfl_flwr.flower_compat.run_superlink`. While
the gate of :mod:`dpcfl_flwr.flower_compat` is open, a SuperNode's empty poll waits up to
``--pull-hold`` seconds for complete work, the ServerApp hears of each reply once all its
objects are in, its Runtime API requests skip the Control API's middleware and FastAPI's
routing, and a refused SuperNode is told why (:mod:`dpcfl_flwr.flower_compat.superlink`).
With the gate closed (another Flower release, ``DPCFL_FLOWER_TUNING=0``) it is stock
``flower-superlink``: the same protocol, slower rounds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..flower_compat import run_superlink
from ..runs.processes import exit_code_of

DEFAULT_PULL_HOLD = 10.0  # seconds; an idle SuperNode then polls ~6x a minute


def split_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our option --pull-hold; the rest, in order, for flower-superlink)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--pull-hold", type=float, default=DEFAULT_PULL_HOLD)
    return parser.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> None:
    options, rest = split_arguments(sys.argv[1:] if argv is None else argv)
    sys.exit(exit_code_of(lambda: run_superlink(rest, options.pull_hold)))


if __name__ == "__main__":
    main()
