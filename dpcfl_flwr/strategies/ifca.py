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
from flwr.app import ArrayRecord

from ..config import ExperimentConfig
from ..protocol import SELECT
from ..silo import Schedule
from .base import ClusteredStrategy, RunObserver, TrainReply


class DPIFCA(ClusteredStrategy):
    name = "ifca"
    discovers_clusters = True

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        if experiment.n_clusters < 2:
            raise ValueError("ifca needs the number of clusters: set n-clusters >= 2")
        super().__init__(experiment, initial, experiment.n_clusters, observer)
        self.choice: dict[int, int] = {}

    def schedule(self) -> Schedule:
        e = self.experiment
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size, e.batch_size,
                        e.select_rounds, e.select_ratio, e.conversion, e.budget_mode)

    def select_window(self) -> range:
        last = self.experiment.num_server_rounds
        if self.experiment.selection == "every-round":
            return range(2, last + 1)
        return range(2, min(1 + self.experiment.select_rounds, last) + 1)

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
