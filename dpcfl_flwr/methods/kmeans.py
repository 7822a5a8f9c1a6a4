"""KM-CDPFL (Werner et al. 2023; a baseline of the older paper versions): myopic clustering.

docs/algorithm.md#k-means-km-cdpfl.

Every round each silo trains the model of its current cluster; the server then runs
k-means++ on that round's DP updates and rebuilds each cluster's model as the mean of its
members' trained models. Single-stage schedule at eps_total; needs M.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from ..config.registry import register
from ..config.settings import ExperimentConfig
from .base import INITIAL, Method, MethodParams, ServerState, TrainReply


class KMeansParams(MethodParams):
    """``[km]``: KM-CDPFL's parameters; it must be told M."""

    n_clusters: int = Field(4, ge=2, description="M, the number of k-means centres")


@register
class KMeansCFL(Method):
    name = "km"
    title = "KM-CDPFL: k-means on every round's DP updates"
    Params = KMeansParams
    discovers_clusters = True
    weighs_updates = False  # each cluster is the plain mean of its members' models
    params: KMeansParams

    def __init__(self, experiment: ExperimentConfig, params: KMeansParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        self.labels: dict[int, int] = {}

    @classmethod
    def fewest_silos(cls, params: BaseModel) -> int:
        """k-means with M centres needs at least M updates."""
        return int(getattr(params, "n_clusters", 1))

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
        models = self.state.models
        starts = np.stack([self.state.initial if replies[p].cluster == INITIAL
                           else models[replies[p].cluster] for p in partitions])
        # imported here: every process that reads a run config loads each method's module,
        # and a silo never clusters (scikit-learn and the pandas it pulls in: ~70 MB)
        from sklearn.cluster import KMeans

        labels = KMeans(self.n_clusters, init="k-means++", n_init=1,
                        random_state=self.experiment.seed * 100_003 + server_round
                        ).fit(matrix).labels_
        trained = starts + matrix  # each silo's model after this round
        for index, partition in enumerate(partitions):
            self.labels[partition] = int(labels[index])
        for m in range(self.n_clusters):
            if np.any(labels == m):
                models[m] = trained[labels == m].mean(axis=0).astype(np.float32)
