"""Per-cluster aggregation of model updates (paper Algorithm 1; docs/algorithm.md#aggregation,
A11)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def cluster_means(
    models: list[np.ndarray], contributions: Mapping[int, tuple[int, np.ndarray]],
    weights: Mapping[int, float],
) -> list[np.ndarray]:
    """theta_m <- theta_m + sum_i w_i dTheta_i / sum_i w_i over the silos that trained m.

    ``contributions`` maps silo -> (cluster it trained, its update); weights are 1 (uniform,
    the paper's 1/count) or N_i. A cluster nobody trained keeps its model.
    """
    out = [m.copy() for m in models]
    for cluster in range(len(models)):
        members = [p for p, (c, _) in contributions.items() if c == cluster]
        if not members:
            continue
        total = sum(weights[p] for p in members)
        if total <= 0:
            raise ValueError(f"aggregation weights of cluster {cluster} sum to {total}")
        step = sum(weights[p] * contributions[p][1].astype(np.float64) for p in members)
        out[cluster] = (models[cluster] + step / total).astype(np.float32)
    return out
