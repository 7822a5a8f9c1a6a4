"""Global (DP-FedAvg, Noble et al. 2021): one model for every silo.

docs/algorithm.md#global-dp-fedavg.

Silos run DP-SGD from the global model with the single-stage schedule at eps_total; the
server averages their updates with uniform weights.
"""

from __future__ import annotations

from ..config import ExperimentConfig
from ..registry import register
from .base import Method, MethodParams, ServerState


@register
class GlobalDPFedAvg(Method):
    name = "global"
    title = "DP-FedAvg: one model for every silo"

    def __init__(self, experiment: ExperimentConfig, params: MethodParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        state.reset_models(1)

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, 0)

    def current_cluster(self, partition: int) -> int:
        return 0
