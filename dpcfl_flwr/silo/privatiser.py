"""How a silo protects what it releases: one interface, one class per mechanism.

A privatiser runs a train round that the silo has accepted whole (fields, work, models) and
returns what leaves the silo. Which one a silo uses is its own node-config setting
(``privatiser``); a message asking for another is refused before any work
(:func:`~.round.train_round`). The built-in ones: :class:`~.gaussian.GaussianDPSGD` (DP-SGD,
(epsilon, delta)-DP per record) and :class:`~.euclidean_laplace.EuclideanLaplace` (d-privacy's
sanitised model, docs/dprivacy.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .requests import TrainRequest
from .silo import Schedule, Silo


@dataclass(frozen=True)
class RoundWork:
    """An accepted train round: the schedule and batch the silo runs (its own b_i where it has
    one), the models to start from (one, or a selection round's candidates) and MR-MTL's
    anchor (None unless sent)."""

    schedule: Schedule
    batch: int | Literal["full"]
    candidates: list[dict[str, torch.Tensor]]
    anchor: dict[str, torch.Tensor] | None
    selecting: bool


@dataclass
class RoundOutcome:
    """What a round produced: ``update`` (released minus received weights, what leaves the
    silo), ``start`` (the weights it trained from) and the reply's numbers. A round that
    trains nothing (the majority baseline, :mod:`.majority`) has neither: None."""

    update: dict[str, torch.Tensor] | None
    start: dict[str, torch.Tensor] | None
    metrics: dict[str, float]


class Privatiser(ABC):
    """A mechanism a silo releases its training through."""

    #: the node-config and message value that selects it
    name: ClassVar[str]

    @abstractmethod
    def check(self, request: TrainRequest, selecting: bool) -> None:
        """Refuse (BadRequest) a request this mechanism cannot serve; before any work."""

    @abstractmethod
    def run(self, silo: Silo, request: TrainRequest, work: RoundWork) -> RoundOutcome:
        """Check the budget, train, privatise and charge one accepted round (under the
        ledger's lock); BudgetExceeded when it would overspend."""
