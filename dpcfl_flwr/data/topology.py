"""A federation's true clusters: how many clients each has, and which client is in which
(the paper's {3, 6, 6, 6}; docs/experiments.md).

Kept apart from :mod:`.partition`, which draws the records with torch: the silo supervisor
(``dpcfl client``) and the deployment commands read a topology and never train.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Topology:
    """How many clients each cluster has; clients are numbered cluster by cluster.

    With the default (3, 6, 6, 6): clients 0..2 form cluster 0 (the minority), 3..8 cluster 1,
    9..14 cluster 2 and 15..20 cluster 3 [CODE].
    """

    cluster_sizes: tuple[int, ...] = (3, 6, 6, 6)

    def __post_init__(self) -> None:
        sizes = tuple(self.cluster_sizes)
        if not sizes:
            raise ValueError("a topology needs at least one cluster, got no cluster sizes")
        for index, size in enumerate(sizes):
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
                raise ValueError(
                    f"cluster {index} has size {size!r}, expected a positive number of clients"
                )
        object.__setattr__(self, "cluster_sizes", tuple(int(s) for s in sizes))

    @classmethod
    def parse(cls, text: str) -> Topology:
        """A topology from its command-line form, e.g. ``"3,6,6,6"``."""
        parts = [part.strip() for part in text.split(",")]
        try:
            sizes = tuple(int(part) for part in parts)
        except ValueError:
            raise ValueError(
                f"cannot read cluster sizes {text!r}: expected comma-separated positive "
                f"integers such as '3,6,6,6'"
            ) from None
        return cls(sizes)

    def __str__(self) -> str:
        return ",".join(str(size) for size in self.cluster_sizes)

    @property
    def num_clients(self) -> int:
        return sum(self.cluster_sizes)

    @property
    def num_clusters(self) -> int:
        """M, the number of true clusters."""
        return len(self.cluster_sizes)

    def cluster_of(self, client_id: int) -> int:
        """The true cluster s(i) of client ``client_id``."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(
                f"client id {client_id} is out of range: topology {self} has clients "
                f"0..{self.num_clients - 1}"
            )
        first = 0
        for cluster, size in enumerate(self.cluster_sizes):
            if client_id < first + size:
                return cluster
            first += size
        raise AssertionError("unreachable: client id was range-checked")

    def members(self, cluster: int) -> list[int]:
        """The client ids of ``cluster``, in increasing order."""
        if not 0 <= cluster < self.num_clusters:
            raise ValueError(
                f"cluster {cluster} is out of range: topology {self} has clusters "
                f"0..{self.num_clusters - 1}"
            )
        first = sum(self.cluster_sizes[:cluster])
        return list(range(first, first + self.cluster_sizes[cluster]))

    def minority_cluster(self) -> int | None:
        """The cluster smaller than every other (the paper's minority, whose accuracy RQ2
        reports); None when no cluster is ({2, 2}, {5, 2, 2}, one cluster)."""
        smallest = min(self.cluster_sizes)
        at_smallest = [c for c, size in enumerate(self.cluster_sizes) if size == smallest]
        return at_smallest[0] if self.num_clusters > 1 and len(at_smallest) == 1 else None
