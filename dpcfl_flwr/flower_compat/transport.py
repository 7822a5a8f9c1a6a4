"""The Fleet API's transport flags of Flower's command-line tools, in one place.

They are Flower-version specific: on Flower 1.39 (our pinned release) the SuperLink serves
the Fleet API over gRPC when told ``--fleet-api-type grpc-rere`` at ``--fleet-api-address``,
and a SuperNode dials it with ``--grpc-rere``. Flower 1.40 makes HTTP the default and
deprecates these flags (its SuperNode no longer takes ``--grpc-rere``); 1.43 removes the gRPC
Fleet service. Moving to those releases changes these two functions, not their callers.
"""

from __future__ import annotations

#: The Fleet API transport of the pinned release.
FLEET_TRANSPORT = "grpc-rere"


def superlink_fleet_flags(address: str) -> list[str]:
    """``flower-superlink``'s flags serving the Fleet API at ``address`` (host:port)."""
    return ["--fleet-api-type", FLEET_TRANSPORT, "--fleet-api-address", address]


def supernode_fleet_flags(superlink: str) -> list[str]:
    """``flower-supernode``'s flags dialling the SuperLink's Fleet API at ``superlink``."""
    return ["--superlink", superlink, f"--{FLEET_TRANSPORT}"]
