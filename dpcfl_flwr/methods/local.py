"""Local (docs/algorithm.md#local): no federation. Each silo trains its own model with DP-SGD.

The server sends theta_init once (so every silo starts alike) and afterwards only asks for
rounds; models never leave the silos, whose replies carry metrics only.
"""

from __future__ import annotations

from ..config.registry import register
from ..protocol import OWN
from .base import INITIAL, Method


@register
class LocalDP(Method):
    name = "local"
    title = "Local: each silo trains its own model, no federation"
    personal = True  # the silos keep their models: no cluster models on the server
    weighs_updates = False

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, INITIAL if server_round == 1 else OWN)

    def current_cluster(self, partition: int) -> int:
        return OWN
