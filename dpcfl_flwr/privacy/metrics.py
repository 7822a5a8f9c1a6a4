"""Private evaluation metrics: what a silo may report about its data besides its DP updates.

An exact test accuracy on a model the server chose is a free query on the silo's records (the
label counts of its split, for instance). In "private" mode a silo releases its evaluation
through the Gaussian mechanism instead, and charges it to its ledger like a DP-SGD step:

- the released vector is (number of correct predictions, sum of per-record cross-entropy
  clipped to ``[0, LOSS_BOUND]`` and divided by ``LOSS_BOUND``); adding or removing one record
  moves each coordinate by at most 1, so its L2 sensitivity is sqrt(2);
- each coordinate gets N(0, (z sqrt 2)^2) noise, i.e. the Gaussian mechanism with noise
  multiplier z, whose RDP is alpha / (2 z^2): one :class:`GaussianSteps` entry at sample rate
  1 and one step, which the ledger composes with everything else.

The split's size (like N_i, which calibration and aggregation use) is treated as public:
docs/threat-model.md lists what leaves a silo.
"""

from __future__ import annotations

import math

import torch

from .ledger import GaussianSteps

#: Per-record cross-entropy (nats) is clipped to this before it is summed: a loss of 10 nats
#: is a probability of 4.5e-5 on the right class, past which the figure says nothing more.
LOSS_BOUND = 10.0


def metric_release_cost(noise_multiplier: float, round_number: int | None) -> GaussianSteps:
    """The ledger entry of one private evaluation (Gaussian mechanism, multiplier z)."""
    return GaussianSteps(noise_multiplier, 1.0, 1, round_number)


def noisy_evaluation(correct: int, clipped_loss_sum: float, count: int,
                     noise_multiplier: float, generator: torch.Generator) -> tuple[float, float]:
    """(loss, accuracy) of a split from its noised sums.

    ``correct``: records predicted right; ``clipped_loss_sum``: sum of per-record losses, each
    clipped to [0, LOSS_BOUND] nats; ``count``: records in the split (public). The accuracy is
    a noisy fraction: it may fall outside [0, 1] and is left there (clamping would bias means).
    """
    if count <= 0:
        raise ValueError("cannot release an evaluation of an empty split")
    if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"metric noise multiplier must be positive, got {noise_multiplier}")
    std = noise_multiplier * math.sqrt(2.0)
    noise = torch.randn(2, generator=generator, dtype=torch.float64) * std
    accuracy = (correct + float(noise[0])) / count
    loss = (clipped_loss_sum / LOSS_BOUND + float(noise[1])) * LOSS_BOUND / count
    return loss, accuracy
