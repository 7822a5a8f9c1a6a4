"""Per-cluster aggregation of model updates (paper Algorithm 1; docs/algorithm.md#aggregation,
A11; the rules: docs/aggregation.md).

Each cluster model moves by the weighted sum of its trainers' updates, weighted by one of the
rules of ``rules.py``; what each cluster's aggregation did is returned for the round's log.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..blas_threads import one_blas_thread
from .facts import DEFAULT_SETTINGS, RuleSettings, UpdateFacts
from .noise import aggregated_noise_level, oracle_noise_level
from .rules import combine


@dataclass
class ClusterAggregation:
    """One cluster's aggregation in one round.

    ``weights`` and ``estimated_variance`` (robust-hdp's sigma_hat_i^2, else None) by
    partition; ``noise_level`` sum_i w_i^2 sigma_i^2 with the facts' true noise variances
    (per coordinate; None if any is unknown; for PFA, the noise of the updates before
    projection); ``oracle_noise_level`` what inverse-true-variance weights would give
    (None if unknown); ``fallback`` as in ``Combination``.
    """

    weights: dict[int, float]
    estimated_variance: dict[int, float] | None
    noise_level: float | None
    oracle_noise_level: float | None
    fallback: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: partitions become string keys."""
        return {
            "weights": {str(p): w for p, w in self.weights.items()},
            "estimated_variance": None if self.estimated_variance is None else
            {str(p): v for p, v in self.estimated_variance.items()},
            "noise_level": self.noise_level,
            "oracle_noise_level": self.oracle_noise_level,
            "fallback": self.fallback,
        }


def cluster_means(
    models: list[np.ndarray], contributions: Mapping[int, tuple[int, np.ndarray]],
    facts: Mapping[int, UpdateFacts], rule: str, settings: RuleSettings = DEFAULT_SETTINGS,
) -> tuple[list[np.ndarray], dict[int, ClusterAggregation]]:
    """theta_m <- theta_m + sum_i w_i dTheta_i over the silos i that trained cluster m.

    ``contributions`` maps partition -> (cluster it trained, its flat update); ``facts``
    holds an entry for each of those partitions. Models come back float32; a cluster nobody
    trained keeps its model and has no entry in the returned aggregations.
    """
    missing = sorted(set(contributions) - set(facts))
    if missing:
        raise ValueError(f"no UpdateFacts for the update(s) of silo(s) {missing}")
    trained = {cluster: sorted(p for p, (c, _) in contributions.items() if c == cluster)
               for cluster in range(len(models))}
    trained = {cluster: members for cluster, members in trained.items() if members}

    def aggregate(cluster: int) -> tuple[np.ndarray, ClusterAggregation]:
        members = trained[cluster]
        updates = np.stack([np.asarray(contributions[p][1], dtype=np.float64) for p in members])
        member_facts = [facts[p] for p in members]
        combination = combine(rule, updates, member_facts, settings)
        step = combination.weights @ combination.updates
        return ((models[cluster].astype(np.float64) + step).astype(np.float32),
                _describe(members, member_facts, combination.weights,
                          combination.estimated_variance, combination.fallback))

    # Clusters are independent, so they run side by side on the machine's cores, each on one
    # BLAS thread (a rule's products are small or memory-bound): robust-hdp over the four
    # clusters of 1,000 silos took 1.7 s of wall time against 2.3 one after the other.
    largest_first = sorted(trained, key=lambda cluster: -len(trained[cluster]))
    workers = max(1, min(len(trained), os.cpu_count() or 1))
    with one_blas_thread(), ThreadPoolExecutor(workers) as pool:
        done = dict(zip(largest_first, pool.map(aggregate, largest_first), strict=True))
    out = [done[cluster][0] if cluster in done else m.copy() for cluster, m in enumerate(models)]
    return out, {cluster: done[cluster][1] for cluster in sorted(done)}


def _describe(
    members: list[int], facts: list[UpdateFacts], weights: np.ndarray,
    estimated: np.ndarray | None, fallback: str | None,
) -> ClusterAggregation:
    known = [f.noise_variance for f in facts]
    true = None if any(v is None for v in known) else [float(v or 0.0) for v in known]
    return ClusterAggregation(
        weights={p: float(w) for p, w in zip(members, weights, strict=True)},
        estimated_variance=None if estimated is None else
        {p: float(v) for p, v in zip(members, estimated, strict=True)},
        noise_level=None if true is None else aggregated_noise_level(weights, true),
        oracle_noise_level=None if true is None else oracle_noise_level(true),
        fallback=fallback,
    )
