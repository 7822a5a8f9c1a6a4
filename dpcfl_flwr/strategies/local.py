"""Local (docs/algorithm.md#local): no federation. Each silo trains its own model with DP-SGD.

The server sends theta_init once (so every silo starts alike) and afterwards only asks for
rounds; models never leave the silos, whose replies carry metrics only.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from ..config import ExperimentConfig
from ..protocol import OWN
from .base import INITIAL, ClusteredStrategy, RunObserver


class LocalDP(ClusteredStrategy):
    name = "local"
    personal = True

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        super().__init__(experiment, initial, 0, observer)

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, INITIAL if server_round == 1 else OWN)

    def current_cluster(self, partition: int) -> int:
        return OWN
