"""KM-CDPFL (Werner et al. 2023; a baseline of the older paper versions): myopic clustering.

docs/algorithm.md#k-means-km-cdpfl.

Every round each silo trains the model of its current cluster; the server then runs
k-means++ on that round's DP updates and rebuilds each cluster's model as the mean of its
members' trained models. Single-stage schedule at eps_total; needs M.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from flwr.app import ArrayRecord
from sklearn.cluster import KMeans

from ..config import ExperimentConfig
from .base import INITIAL, ClusteredStrategy, RunObserver, TrainReply


class KMeansCFL(ClusteredStrategy):
    name = "km"
    discovers_clusters = True

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        if experiment.n_clusters < 2:
            raise ValueError("km needs the number of clusters: set n-clusters >= 2")
        super().__init__(experiment, initial, experiment.n_clusters, observer)
        self.labels: dict[int, int] = {}

    def silos_needed(self) -> int:
        """k-means with M centres needs at least M updates."""
        return self.n_clusters

    def round_batch(self, server_round: int) -> int | Literal["full"]:
        return self.experiment.batch_size

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return {p: self.labels.get(p, INITIAL) for p in partitions}

    def current_cluster(self, partition: int) -> int:
        return self.labels.get(partition, 0)

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        updates = {p: r.update for p, r in replies.items() if r.update is not None}
        if len(updates) < self.n_clusters:
            return  # too few updates to cluster this round: keep assignments and models
        partitions = sorted(updates)
        matrix = np.stack([updates[p] for p in partitions])
        starts = np.stack([self.initial if replies[p].cluster == INITIAL
                           else self.models[replies[p].cluster] for p in partitions])
        labels = KMeans(self.n_clusters, init="k-means++", n_init=1,
                        random_state=self.experiment.seed * 100_003 + server_round
                        ).fit(matrix).labels_
        trained = starts + matrix  # each silo's model after this round
        for index, partition in enumerate(partitions):
            self.labels[partition] = int(labels[index])
        for m in range(self.n_clusters):
            if np.any(labels == m):
                self.models[m] = trained[labels == m].mean(axis=0).astype(np.float32)
