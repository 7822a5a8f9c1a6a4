"""Private evaluation metrics: what a silo may report about its test split, and the figures
(accuracy, balanced accuracy, AUROC) read from it.

An exact test accuracy on a model the server chose is a free query on the silo's records (the
label counts of its split, for instance). In "private" mode a silo releases its evaluation
through the Gaussian mechanism instead, and charges it to its ledger like a DP-SGD step
(docs/privacy.md#private-evaluation-metrics).

The released vector, for K classes and a test split of ``count`` records (public, like N_i):

    v = (correct, clipped loss sum / LOSS_BOUND, c_0 .. c_{K-1}, n_0 .. n_{K-1}
         [, h_{0,0} .. h_{0,B-1}, h_{1,0} .. h_{1,B-1}  when K = 2])

``correct``: records predicted right; the loss sum: per-record cross-entropy clipped to
``[0, LOSS_BOUND]`` nats; ``c_k`` / ``n_k``: records of true class k predicted right / in all;
``h_{k,j}``: records of true class k whose positive-class score (softmax probability of class
1) falls in bin j of :data:`SCORE_BINS` equal bins of [0, 1].

Sensitivity (add/remove adjacency, docs/privacy.md#adjacency). Adding or removing one record
(x, y) changes ``correct`` by 1[prediction = y] in {0, 1}; the scaled loss sum by its clipped
loss / LOSS_BOUND in [0, 1]; ``c_y`` by the same 1[prediction = y]; ``n_y`` by exactly 1; for
K = 2 exactly one bin ``h_{y,j}`` by 1; and no other coordinate, since every other coordinate
counts other classes or other bins. So the change has at most five non-zero coordinates
(four for K != 2), each of absolute value at most 1, and

    ||v(D) - v(D')||_2 <= sqrt(5) (K = 2),  sqrt(4) = 2 (K != 2)      (:func:`release_sensitivity`)

with equality for a record whose output the server's weights make NaN or infinite at its own
class: that counts as a right prediction (argmax takes a NaN as the largest) and its loss as
LOSS_BOUND (:func:`~..dpsgd.training.bounded_losses`); on finite outputs a right prediction
costs at most ln K nats, so the bound is not reached there. Each
coordinate gets N(0, (z Delta)^2) noise, Delta that sensitivity and z = ``metrics-noise``: the
Gaussian mechanism with noise multiplier z, whose RDP is alpha / (2 z^2) whatever Delta is (the
noise is scaled to it). That is one :class:`GaussianSteps` entry at sample rate 1 and one step,
which the ledger composes with everything else: the charge per evaluation is what it was when
the vector held (correct, loss) alone; the noise per coordinate grew from z sqrt 2 to z Delta.
Under replacement adjacency one record moves two classes' (c, n) and two bins, ||.||_2 <=
sqrt(8) (K = 2) or sqrt(6): that guarantee follows by group privacy, as for DP-SGD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .ledger import GaussianSteps

#: Per-record cross-entropy (nats) is clipped to this before it is summed: a loss of 10 nats
#: is a probability of 4.5e-5 on the right class, past which the figure says nothing more.
LOSS_BOUND = 10.0

#: Equal bins of the positive-class score in [0, 1] (two classes only). AUROC from such a
#: histogram counts pairs within one bin as ties: it is off from the exact figure by at most
#: half the share of (negative, positive) pairs that share a bin (:func:`auroc_bin_error`).
SCORE_BINS = 20

#: A class enters balanced accuracy and AUROC when its reported total is at least this many
#: noise standard deviations (and one record): an absent class's noisy total passes with
#: probability 2.3%, and a recall with a denominator in the noise would be meaningless.
PRESENT_STDS = 2.0


@dataclass(frozen=True)
class EvaluationSums:
    """A test split's sums (module docstring): exact integers, or noised releases of them.

    ``class_correct`` and ``class_count`` have one entry per class; ``score_histogram`` is
    (2, SCORE_BINS) for two classes (row: the true class), else None. ``count``: records in
    the split (public). ``noise_std``: the Gaussian noise's standard deviation on every sum,
    in records (0: exact)."""

    count: int
    correct: float
    loss_sum: float
    class_correct: np.ndarray
    class_count: np.ndarray
    score_histogram: np.ndarray | None = None
    noise_std: float = field(default=0.0)

    @property
    def accuracy(self) -> float:
        """A fraction; with noise it may fall outside [0, 1] and is left there (clamping
        would bias means)."""
        return self.correct / self.count

    @property
    def loss(self) -> float:
        """Mean per-record cross-entropy (nats; clipped to LOSS_BOUND where the sums were)."""
        return self.loss_sum / self.count


def release_sensitivity(num_classes: int) -> float:
    """L2 sensitivity of the released vector to adding or removing one record (module
    docstring): sqrt(5) with the two classes' score histogram, else 2."""
    return math.sqrt(5.0) if num_classes == 2 else 2.0


def metric_release_cost(noise_multiplier: float, round_number: int | None) -> GaussianSteps:
    """The ledger entry of one private evaluation (Gaussian mechanism, multiplier z)."""
    return GaussianSteps(noise_multiplier, 1.0, 1, round_number)


def noisy_release(sums: EvaluationSums, noise_multiplier: float,
                  generator: torch.Generator) -> EvaluationSums:
    """``sums`` (exact) through the Gaussian mechanism: every coordinate of the released
    vector plus N(0, (z Delta)^2), Delta = :func:`release_sensitivity`; the count stays
    exact (public). Charge :func:`metric_release_cost` before anything of it leaves."""
    if sums.count <= 0:
        raise ValueError("cannot release an evaluation of an empty split")
    if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"metric noise multiplier must be positive, got {noise_multiplier}")
    classes = len(sums.class_count)
    std = noise_multiplier * release_sensitivity(classes)
    bins = 0 if sums.score_histogram is None else sums.score_histogram.size
    noise = (torch.randn(2 + 2 * classes + bins, generator=generator, dtype=torch.float64)
             * std).numpy()
    histogram = None
    if sums.score_histogram is not None:
        histogram = sums.score_histogram + noise[2 + 2 * classes:].reshape(
            sums.score_histogram.shape)
    return EvaluationSums(
        sums.count, sums.correct + noise[0],
        (sums.loss_sum / LOSS_BOUND + noise[1]) * LOSS_BOUND,
        sums.class_correct + noise[2:2 + classes],
        sums.class_count + noise[2 + classes:2 + 2 * classes], histogram, std)


def _present(class_count: np.ndarray, noise_std: float) -> np.ndarray:
    return class_count >= max(1.0, PRESENT_STDS * noise_std)


def balanced_accuracy(class_correct: np.ndarray, class_count: np.ndarray,
                      noise_std: float = 0.0) -> float | None:
    """Mean over the classes present of recall c_k / n_k, a fraction (None: no class
    present). Exact sums give scikit-learn's ``balanced_accuracy_score``; with noisy sums a
    class is present when its total reaches :data:`PRESENT_STDS` noise deviations, and each
    recall is clipped to [0, 1] (a ratio of two noisy figures is no unbiased estimate anyway,
    and clipping keeps one class's noise from moving the mean by more than 1 / K)."""
    correct = np.asarray(class_correct, dtype=np.float64)
    count = np.asarray(class_count, dtype=np.float64)
    present = _present(count, noise_std)
    if not present.any():
        return None
    return float(np.mean(np.clip(correct[present] / count[present], 0.0, 1.0)))


def auroc(score_histogram: np.ndarray, class_count: np.ndarray,
          noise_std: float = 0.0) -> float | None:
    """Area under the ROC curve of class 1 against class 0 from their score histograms, by
    the trapezoid rule through the thresholds at the bin edges:

        AUROC = sum_j h0_j (sum_{i > j} h1_i + h1_j / 2) / (sum h0 * sum h1),

    i.e. the Mann-Whitney statistic with pairs in one bin counted as ties. Noisy bins are
    clipped at 0 first. None when either class is absent (its total below
    :data:`PRESENT_STDS` noise deviations, or one record) or its clipped histogram is empty."""
    if not _present(np.asarray(class_count, dtype=np.float64), noise_std).all():
        return None
    negatives, positives = np.clip(np.asarray(score_histogram, dtype=np.float64), 0.0, None)
    total_negative, total_positive = negatives.sum(), positives.sum()
    if not (total_negative > 0 and total_positive > 0):
        return None
    above = np.cumsum(positives[::-1])[::-1] - positives  # sum_{i > j} h1_i
    return float(np.sum(negatives * (above + positives / 2)) / (total_negative * total_positive))


def auroc_bin_error(score_histogram: np.ndarray) -> float:
    """The most the histogram's AUROC can differ from the exact one of the same scores (exact
    histograms): half the share of (negative, positive) pairs in one bin, whose true order
    the histogram does not know."""
    negatives, positives = np.asarray(score_histogram, dtype=np.float64)
    return float(np.sum(negatives * positives) / (2 * negatives.sum() * positives.sum()))


def score_bins(scores: torch.Tensor, bins: int = SCORE_BINS) -> torch.Tensor:
    """The bin of each positive-class score in [0, 1] (the last bin includes 1); a score
    that is not a number (weights that overflow on one record) falls in the middle bin, so
    every record lands in exactly one bin whatever the weights."""
    scores = torch.nan_to_num(scores.double(), nan=0.5)
    return (scores * bins).floor().clamp(0, bins - 1).long()
