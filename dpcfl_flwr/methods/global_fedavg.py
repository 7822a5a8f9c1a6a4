"""Global (DP-FedAvg, Noble et al. 2021): one model for every silo.

docs/algorithm.md#global-dp-fedavg.

Silos run DP-SGD from the global model with the single-stage schedule at eps_total; the
server averages their updates with uniform weights.
"""

from __future__ import annotations

from ..config.registry import register
from .base import Method


@register
class GlobalDPFedAvg(Method):
    name = "global"
    title = "DP-FedAvg: one model for every silo"

    def initial_clusters(self) -> int:
        return 1

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, 0)

    def current_cluster(self, partition: int) -> int:
        return 0
