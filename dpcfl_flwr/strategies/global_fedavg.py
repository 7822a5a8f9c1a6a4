"""Global (DP-FedAvg, Noble et al. 2021): one model for every silo.

docs/algorithm.md#global-dp-fedavg.

Silos run DP-SGD from the global model with the single-stage schedule at eps_total; the
server averages their updates with uniform weights.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from ..config import ExperimentConfig
from .base import ClusteredStrategy, RunObserver


class GlobalDPFedAvg(ClusteredStrategy):
    name = "global"

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        super().__init__(experiment, initial, 1, observer)

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, 0)

    def current_cluster(self, partition: int) -> int:
        return 0
