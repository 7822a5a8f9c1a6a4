"""Server strategies: R-DPCFL and the paper's baselines, all on one clustered base."""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord

from ..config import ExperimentConfig
from .base import ClusteredStrategy, RunObserver
from .global_fedavg import GlobalDPFedAvg
from .ifca import DPIFCA
from .kmeans import KMeansCFL
from .local import LocalDP
from .mrmtl import MRMTL
from .oracle import OracleDPCFL
from .rdpcfl import RDPCFL

STRATEGIES: dict[str, type[ClusteredStrategy]] = {
    "rdpcfl": RDPCFL, "global": GlobalDPFedAvg, "local": LocalDP, "ifca": DPIFCA,
    "mrmtl": MRMTL, "oracle": OracleDPCFL, "km": KMeansCFL,
}


def build_strategy(experiment: ExperimentConfig, initial: ArrayRecord,
                   observer: RunObserver | None = None) -> ClusteredStrategy:
    """The strategy of ``experiment.method``."""
    try:
        cls = STRATEGIES[experiment.method]
    except KeyError:
        raise ValueError(f"method {experiment.method!r} is not available; choose from "
                         f"{', '.join(sorted(STRATEGIES))}") from None
    factory: Any = cls  # subclasses take (experiment, initial, observer)
    return factory(experiment, initial, observer)


__all__ = [
    "DPIFCA", "MRMTL", "RDPCFL", "STRATEGIES", "ClusteredStrategy", "GlobalDPFedAvg",
    "KMeansCFL", "LocalDP", "OracleDPCFL", "RunObserver", "build_strategy",
]
