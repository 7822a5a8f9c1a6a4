"""DP-IFCA (Ghosh et al. 2020 with private selection): clustering by losses.

docs/algorithm.md#dp-ifca.

M cluster models start equal (theta_init). Round 1: each silo trains a cluster drawn uniformly
(what selecting among identical models amounts to), and the server aggregates. Rounds
2..1+T_sel: silos receive all M models and choose one with the exponential mechanism on their
train accuracy, charged like R-DPCFL's selections (the same budget split); then the last
choice is frozen ("10%" variant). Single-stage noise calibrated to eps_train. Needs M.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..config.registry import register
from ..config.settings import ExperimentConfig
from ..privacy.schedule import Schedule
from ..protocol import SELECT
from .base import Method, SelectionParams, ServerState, TrainReply


class IFCAParams(SelectionParams):
    """``[ifca]``: DP-IFCA's parameters; it must be told M."""

    n_clusters: int = Field(4, ge=2, description="M, the number of cluster models")


@register
class DPIFCA(Method):
    name = "ifca"
    title = "DP-IFCA: each silo picks the cluster model with the best train accuracy"
    Params = IFCAParams
    discovers_clusters = True
    params: IFCAParams

    def __init__(self, experiment: ExperimentConfig, params: IFCAParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        self.choice: dict[int, int] = {}

    def schedule(self) -> Schedule:
        e, p = self.experiment, self.params
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size, e.batch_size,
                        p.select_rounds(e.num_server_rounds), p.select_ratio, e.conversion,
                        e.budget_mode)

    def select_window(self) -> range:
        """Rounds with private selection: 2..1+T_sel, or every round after the first."""
        last = self.experiment.num_server_rounds
        if self.params.selection == "every-round":
            return range(2, last + 1)
        return range(2, min(1 + self.params.select_rounds(last), last) + 1)

    def stage(self, server_round: int) -> str:
        if server_round == 1:
            return "random"
        return "select" if server_round in self.select_window() else "frozen"

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        stage = self.stage(server_round)
        if stage == "random":
            rng = np.random.default_rng([self.experiment.seed, 1])
            return {p: int(rng.integers(self.n_clusters)) for p in partitions}
        if stage == "select":
            return dict.fromkeys(partitions, SELECT)
        return {p: self.current_cluster(p) for p in partitions}

    def current_cluster(self, partition: int) -> int:
        return self.choice.get(partition, 0)

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        for partition, reply in replies.items():
            self.choice[partition] = reply.cluster
        super().absorb(server_round, replies)
