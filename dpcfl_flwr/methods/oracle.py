"""O-DPCFL (docs/algorithm.md#oracle-o-dpcfl): clustered DP-FL told the true clusters.

Only for evaluation: the true-cluster labels come from the silos' query replies (the topology
in simulation, the silo file in deployment). Same aggregation as R-DPCFL, single-stage
schedule at eps_total, no selection. Unlike the authors' code, round 1 is trained too.
"""

from __future__ import annotations

from ..config.registry import register
from .base import Method


@register
class OracleDPCFL(Method):
    name = "oracle"
    title = "O-DPCFL: clustered DP-FL told the true clusters (evaluation only)"

    def initial_clusters(self) -> int:
        return self.experiment.topology.num_clusters

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return {p: self.current_cluster(p) for p in partitions}

    def current_cluster(self, partition: int) -> int:
        cluster = self.state.silos[partition].true_cluster
        if not 0 <= cluster < self.n_clusters:
            raise ValueError(f"silo {partition} reports true cluster {cluster}, outside "
                             f"0..{self.n_clusters - 1}: the oracle needs every silo's label")
        return cluster
