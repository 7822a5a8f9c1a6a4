"""What one training round did (:class:`RoundReport`), for logs, progress and the results
files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RoundReport:
    """What happened in one training round, for logs, progress and the results files.
    Times in seconds; accuracies in [0, 1]; silos by partition."""

    round: int
    stage: str
    seconds: float
    trained: dict[int, int]  # partition -> cluster it trained
    val_accuracy: dict[int, float]  # of the silos that report one (private metrics do not)
    refused: list[int]
    dropped: list[int]
    server_seconds: float = 0.0
    #: wall of the round's evaluation exchange, after its training (0: none this round)
    evaluate_seconds: float = 0.0
    test_accuracy: dict[int, float] | None = None
    #: of the silos evaluated whose reply gives them (docs/privacy.md#private-evaluation-metrics)
    test_balanced_accuracy: dict[int, float] = field(default_factory=dict)
    test_auroc: dict[int, float] = field(default_factory=dict)  # two classes only
    client_cpu_seconds: dict[int, float] = field(default_factory=dict)
    #: by cluster: the aggregation's weights, noise levels and fallback (docs/aggregation.md)
    aggregation: dict[int, dict[str, Any]] = field(default_factory=dict)

    def cluster_sizes(self, n_clusters: int) -> list[int]:
        counts = np.bincount([c for c in self.trained.values() if c >= 0], minlength=n_clusters)
        return counts.tolist()
