"""The server's Flower Strategy: one ClusteredStrategy that runs any registered method."""

from __future__ import annotations

from flwr.app import ArrayRecord

from ..config.settings import ExperimentConfig
from .silos import TooFewSilos
from .strategy import ClusteredStrategy, RoundReport, RunObserver


def build_strategy(experiment: ExperimentConfig, initial: ArrayRecord,
                   observer: RunObserver | None = None) -> ClusteredStrategy:
    """The strategy of ``experiment`` (its ``method`` from the registry); ``initial``:
    theta_init; ``observer``: told of the silos and of every round."""
    return ClusteredStrategy(experiment, initial, observer)


__all__ = ["ClusteredStrategy", "RoundReport", "RunObserver", "TooFewSilos", "build_strategy"]
