"""MR-MTL (mean-regularised multi-task learning; docs/algorithm.md#mr-mtl).

Each silo i keeps a personal model theta_i and minimises f_i(theta_i) + (lambda/2)
||theta_i - theta_bar||^2, theta_bar the uniform mean of the personal models. The server keeps
the personal models (from the silos' DP updates) and sends each silo its model and theta_bar.

``mrmtl-variant = "correct"`` (default) adds lambda (theta_i - theta_bar) to the privatised
gradient, which is data-independent and so free. ``"authors"`` reproduces the authors' code,
where the term sits in the loss and Opacus' per-sample clipping drops it: the silos then train
exactly as Local does (reported with the result, see README).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from ..config import ExperimentConfig
from ..protocol import ANCHOR, WireModel, pack
from .base import ClusteredStrategy, RunObserver


class MRMTL(ClusteredStrategy):
    name = "mrmtl"

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        # One "cluster" per silo: its personal model. Sized once the silos are known.
        super().__init__(experiment, initial, 0, observer)

    def _ensure_models(self) -> None:
        slots = max(self.silos, default=-1) + 1
        while len(self.models) < slots:
            self.models.append(self.initial.copy())
        self.n_clusters = len(self.models)

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        self._ensure_models()
        return {p: p for p in partitions}

    def current_cluster(self, partition: int) -> int:
        self._ensure_models()
        return partition

    def anchor(self) -> np.ndarray:
        """theta_bar: the uniform mean of the silos' personal models."""
        return np.mean([self.models[p] for p in sorted(self.silos)], axis=0).astype(np.float32)

    def train_config(self, server_round: int, cluster: int) -> dict[str, Any]:
        return {**super().train_config(server_round, cluster),
                "prox-lambda": self.experiment.mrmtl_lambda,
                "prox-variant": self.experiment.mrmtl_variant}

    def extra_models(self, server_round: int) -> dict[str, WireModel]:
        return {ANCHOR: pack(self.anchor())}

    def results(self) -> dict[str, Any]:
        return {"mrmtl_variant": self.experiment.mrmtl_variant,
                "mrmtl_lambda": self.experiment.mrmtl_lambda}
