"""Gradient canaries: records the auditor controls, seen by DP-SGD only through their gradients.

A canary is a record whose clipped per-sample gradient is always C e_j, C the clipping norm and
e_j a coordinate of the model's trainable parameters (a Dirac canary, as in the white-box
audits of Steinke, Nasr & Jagielski 2023). It is the strongest record a DP-SGD step has to hide:
its gradient has the largest norm clipping lets through and points the same way at every step,
while real records' gradients, spread over all coordinates, move any one coordinate little.
The m canaries take distinct coordinates, so each is measured along its own axis.

Each canary is included in the silo's data with probability 1/2, independently; an included
canary enters every step it is Poisson-sampled in, at the step's rate, as a real record would.
After training, a canary's score is how far the parameters moved against its gradient:
<theta_start - theta_end, e_j>, which sums its contribution over every step it was sampled in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """The trainable parameters as one vector, in ``model.parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


class DiracCanaries:
    """``count`` gradient canaries on distinct coordinates of ``model``, each in with
    probability 1/2 (``included``); ``rng`` draws the coordinates, the inclusion and every
    step's Poisson sampling."""

    def __init__(self, model: nn.Module, count: int, clip_norm: float,
                 rng: np.random.Generator) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sizes = [p.numel() for p in self.params]
        dimension = sum(self.sizes)
        if not 1 <= count <= dimension:
            raise ValueError(f"{count} canaries need 1 to {dimension} distinct coordinates "
                             f"(the model's trainable parameters)")
        if not clip_norm > 0:
            raise ValueError(f"clip norm must be positive, got {clip_norm}")
        self.clip_norm, self.rng, self.dimension = clip_norm, rng, dimension
        self.coordinates = torch.from_numpy(rng.choice(dimension, size=count, replace=False))
        self.included = rng.random(count) < 0.5
        self.draws = np.zeros(count, dtype=np.int64)  # steps each canary was sampled in

    @property
    def count(self) -> int:
        return len(self.included)

    def clipped_sum(self, sample_rate: float) -> list[torch.Tensor]:
        """The summed clipped gradients of the included canaries Poisson-sampled at
        ``sample_rate`` into one step, shaped like the trainable parameters."""
        sampled = self.included & (self.rng.random(self.count) < sample_rate)
        self.draws += sampled
        flat = torch.zeros(self.dimension, dtype=self.params[0].dtype)
        flat[self.coordinates[torch.from_numpy(sampled)]] = self.clip_norm
        return [part.view_as(p) for part, p in zip(flat.split(self.sizes), self.params,
                                                    strict=True)]

    def scores(self, start: torch.Tensor, end: torch.Tensor) -> np.ndarray:
        """Each canary's score: the descent along its coordinate from ``start`` to ``end``
        (flat parameter vectors, :func:`flat_parameters`)."""
        return (start - end)[self.coordinates].double().numpy()


@dataclass(frozen=True)
class Guesses:
    """The membership test's outcome: ``made`` guesses (k+ "in", k- "out"), ``correct`` right."""

    made: int
    correct: int
    correct_in: int
    correct_out: int


def guess_membership(scores: np.ndarray, included: np.ndarray, k_in: int,
                     k_out: int) -> Guesses:
    """Guess "in" for the ``k_in`` highest scores and "out" for the ``k_out`` lowest, abstain
    on the rest (Steinke et al.'s guesser; k+ and k- are fixed before the scores are seen)."""
    if k_in < 0 or k_out < 0 or k_in + k_out > len(scores):
        raise ValueError(f"k+ = {k_in} and k- = {k_out} guesses need k+ + k- <= "
                         f"{len(scores)} canaries, both >= 0")
    order = np.argsort(scores, kind="stable")
    correct_out = int(np.sum(~included[order[:k_out]]))
    correct_in = int(np.sum(included[order[len(order) - k_in:]])) if k_in else 0
    return Guesses(k_in + k_out, correct_in + correct_out, correct_in, correct_out)
