"""Flower 1.39's node registration through one Control API client in this process: the
internals behind ``dpcfl server --register`` when the gate is open.

``flwr supernode register KEY CONNECTION`` is a Python process that imports Flower's command
line (~0.7 s of CPU) to make one request. A SuperLink with 21 silos paid that 21 times at each
start: 15 s of CPU, and 5-8 minutes of a docker compose start on two busy cores. Here the
same request (Flower's ``RegisterNodeRequest`` with the key in Flower's byte form and the
silo's name) goes out once per key over one client built from the same connection in
``$FLWR_HOME/config.toml``, and Flower's own error handling turns a refusal into the line the
command would print, ``[code: N] ...`` included.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.cli.flower_config import read_superlink_connection
from flwr.cli.utils import flwr_cli_exc_handler, init_http_client_from_connection
from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611
from flwr.supercore.primitives.asymmetric import public_key_to_bytes


@contextlib.contextmanager
def _flower_home(home: Path) -> Iterator[None]:
    """Flower reads its configuration from ``$FLWR_HOME``: set it for the block only."""
    before = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = before


def register_keys(flwr_home: Path, connection: str, keys: Sequence[Path]
                  ) -> list[tuple[bool, str | None]]:
    """For each OpenSSH EC public key in ``keys`` (validated by the caller), in order:
    (True, None) when the SuperLink of ``connection`` registered it under the key file's stem,
    else (False, Flower's one-line refusal). A SuperLink that cannot be reached refuses every
    key with Flower's "unavailable" line."""
    outcomes: list[tuple[bool, str | None]] = []
    with _flower_home(flwr_home):
        try:
            client = init_http_client_from_connection(read_superlink_connection(connection))
        except click.ClickException as error:
            return [(False, error.format_message())] * len(keys)
        try:
            for key in keys:
                public = serialization.load_ssh_public_key(key.read_bytes())
                if not isinstance(public, ec.EllipticCurvePublicKey):
                    outcomes.append((False, f"{key} is not an elliptic-curve public key"))
                    continue
                request = RegisterNodeRequest(public_key=public_key_to_bytes(public),
                                              name=key.stem)
                try:
                    with flwr_cli_exc_handler():
                        answer = client.RegisterNode(request=request)
                except click.ClickException as error:
                    outcomes.append((False, error.format_message()))
                    continue
                outcomes.append((True, None) if answer.node_id else
                                (False, "the SuperLink returned no node id"))
        finally:
            client.close()
    return outcomes
