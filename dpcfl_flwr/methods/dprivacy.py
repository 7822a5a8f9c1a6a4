"""d-private clustered FL (paper 004, Alg. 1): IFCA with sanitised models and server k-means.

docs/dprivacy.md.

Every round every silo receives the k hypotheses, picks the one of lowest loss on its own
training records (not a private choice: the paper does not protect it), trains it with plain
SGD, and releases it through the Euclidean Laplace mechanism with its own noise multiplier v
(``dpcfl_flwr.privacy.dprivacy``; v = 0: no noise, IFCA without privacy). The server runs
k-means on the released models, seeded at the current hypotheses, and each hypothesis becomes
the mean of its k-means cluster; an empty cluster keeps its hypothesis (logged; paper 004
leaves the case open). k = 1 is
FedAvg with sanitisation.

The hypotheses start equal (theta_init), which k-means cannot tell apart: round 1 gives each
silo a hypothesis drawn uniformly (as DP-IFCA does) and groups the released models by it.

What the silos spend is not (epsilon, delta)-DP: each release costs n / v of d-privacy
leakage, kept apart in the silo's ledger (docs/dprivacy.md#the-ledger).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field

from ..config.registry import register
from ..config.settings import ExperimentConfig
from ..protocol import SELECT
from .base import INITIAL, Method, MethodParams, ServerState, TrainReply

logger = logging.getLogger(__name__)


class DPrivacyParams(MethodParams):
    """``[dprivacy]``: k, and (simulation only: a deployed silo sets its own) the silos' noise
    multiplier v and leakage budget."""

    n_clusters: int = Field(2, ge=1, description="k, the number of hypotheses")
    noise_multiplier: float = Field(1.0, ge=0.0, allow_inf_nan=False,
                                    description="v: expected noise norm / update norm")
    leakage_budget: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                                  description="sum of n/v a silo may release; 0: no limit")


@register
class DPrivacyCFL(Method):
    name = "dprivacy"
    title = "d-private clustered FL: sanitised models, k-means on the server (paper 004)"
    Params = DPrivacyParams
    discovers_clusters = True
    weighs_updates = False  # k-means means; noise-aware weights would punish large updates
    privatiser: ClassVar[str] = "dprivacy"
    params: DPrivacyParams

    def __init__(self, experiment: ExperimentConfig, params: DPrivacyParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        self.labels: dict[int, int] = {}

    @classmethod
    def silo_defaults(cls, params: BaseModel) -> dict[str, Any]:
        assert isinstance(params, DPrivacyParams)
        return {"privatiser": "dprivacy", "dprivacy_noise": params.noise_multiplier,
                "dprivacy_leakage_budget": params.leakage_budget}

    def silo_settings(self, server_round: int, cluster: int) -> dict[str, Any]:
        return {"privatiser": "dprivacy"}

    def chooses_learning_rate(self) -> bool:
        """No: a silo's choice would be a release d-privacy's ledger does not cover; a run
        without a learning rate trains at the rule's middle candidate."""
        return False

    def stage(self, server_round: int) -> str:
        return "random" if server_round == 1 and self.n_clusters > 1 else "choose"

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        if self.n_clusters == 1:
            return dict.fromkeys(partitions, 0)
        if server_round == 1:
            rng = np.random.default_rng([self.experiment.seed, 1])
            return {p: int(rng.integers(self.n_clusters)) for p in partitions}
        return dict.fromkeys(partitions, SELECT)

    def current_cluster(self, partition: int) -> int:
        return self.labels.get(partition, 0)

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        models = self.state.models
        released = {p: (models[r.cluster] if r.cluster >= 0 else self.state.initial) + r.update
                    for p, r in replies.items() if r.update is not None and r.cluster != INITIAL}
        if not released:
            return
        partitions = sorted(released)
        points = np.stack([released[p] for p in partitions]).astype(np.float64)
        if server_round == 1 or self.n_clusters == 1:
            labels = np.array([replies[p].cluster for p in partitions])
        else:
            labels = self._kmeans(points, np.stack(models).astype(np.float64))
        for m in range(self.n_clusters):
            members = labels == m
            if members.any():
                models[m] = points[members].mean(axis=0).astype(np.float32)
            else:
                logger.info("round %d: no released model is nearest hypothesis %d: it is kept",
                            server_round, m)
        self.labels.update({p: int(label) for p, label in zip(partitions, labels, strict=True)})

    def _kmeans(self, points: np.ndarray, hypotheses: np.ndarray,
                iterations: int = 100) -> np.ndarray:
        """Labels of Lloyd's k-means seeded at the hypotheses (Euclidean), run until the
        labels stop changing. A centre no point is nearest to stays where it is (library
        k-means would move it onto a far point, inventing a cluster)."""
        centres, labels = hypotheses.copy(), np.full(len(points), -1)
        for _ in range(iterations):
            # ||x - c||^2 up to the per-point ||x||^2: no points x centres x p array (GBs
            # for a ResNet's 11M parameters)
            distances = (centres ** 2).sum(axis=1)[None, :] - 2.0 * points @ centres.T
            new = distances.argmin(axis=1)
            if np.array_equal(new, labels):
                break
            labels = new
            for m in range(len(centres)):
                if (labels == m).any():
                    centres[m] = points[labels == m].mean(axis=0)
        return labels
