"""Aggregation rules: how a cluster's model combines its silos' updates (paper 002 Table 1,
§3.4; docs/aggregation.md).

``combine`` applies one rule to one cluster's updates; ``cluster_means`` does it for every
cluster of a round. The rules are listed in ``RULES``.
"""

from .clusters import ClusterAggregation, cluster_means
from .facts import Combination, RuleSettings, UpdateFacts
from .noise import aggregated_noise_level, dp_noise_variance, oracle_noise_level
from .rpca import PcpResult, principal_component_pursuit
from .rules import RULES, combine

__all__ = [
    "RULES",
    "ClusterAggregation",
    "Combination",
    "PcpResult",
    "RuleSettings",
    "UpdateFacts",
    "aggregated_noise_level",
    "cluster_means",
    "combine",
    "dp_noise_variance",
    "oracle_noise_level",
    "principal_component_pursuit",
]
