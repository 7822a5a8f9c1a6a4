"""Reading the silos' replies: every number checked before it can touch the server's state.

One silo running other code (or broken arithmetic) must cost its own round, not the run or,
through a NaN in an average, every silo's model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message

from ..aggregation import dp_noise_variance
from ..methods.base import INITIAL, TrainReply
from ..privacy.metrics import auroc, balanced_accuracy
from ..protocol import (
    MAJORITY,
    METRICS,
    OWN,
    UPDATE,
    ModelLayout,
    evaluation_of,
    metrics_of,
    model_records,
    number,
)

#: How many times the median norm of a round's updates one update's norm may be
#: (docs/algorithm.md#updates-far-off-the-others). Honest DP updates differ by their noise:
#: over the paper's nine uneven budgets (Dist1-Dist9, its batch sizes) the noisiest silo's
#: noise norm is at most 12x the median silo's; one update 1,000x the others' leaves both
#: clusterings with one cluster for nearly every other silo, and ~1e9x made the noise-aware
#: fit overflow.
MAX_NORM_RATIO = 1e3


def reply_numbers(message: Message, keys: tuple[str, ...],
                  record: str = METRICS) -> tuple[Mapping[str, Any], list[float]]:
    """A reply's record of numbers ``record`` (see :func:`~..protocol.metrics_of`) and its
    fields ``keys`` as numbers; ValueError naming what is missing or not a number."""
    try:
        metrics = metrics_of(message, record)
        return metrics, [number(metrics, key) for key in keys]
    except KeyError as exc:
        raise ValueError(f"no {exc} in the reply") from exc


def known_number(record: Mapping[str, Any], key: str) -> float | None:
    """An optional number of a reply: None when it is absent, not a number or not finite (a
    silo that keeps its metrics private sends no ``val-accuracy``)."""
    value = record.get(key)
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    return None


def train_reply(message: Message, layout: ModelLayout, n_clusters: int,
                clip_norm: float, num_classes: int) -> TrainReply:
    """A silo's train reply, checked: only ``cluster``, ``epsilon-spent`` and
    ``noise-multiplier`` must be there; a silo's own numbers about its data (validation
    accuracy and loss) and its round's ``batch-size`` and ``steps`` are optional.
    ``layout``: the model's, which the update must have; ``n_clusters``: M, which bounds the
    cluster it says it trained; ``clip_norm``: C, to size the noise it reports (only for
    evaluation figures, :attr:`TrainReply.noise_variance`); ``num_classes``: K, which bounds
    the class a majority round chose (such a reply names its class and carries no update).
    ValueError says why a reply cannot be used."""
    metrics, numbers = reply_numbers(message, ("cluster", "epsilon-spent", "noise-multiplier"))
    cluster = int(numbers[0])
    models = model_records(message.content)
    update = layout.flatten(models[UPDATE], writable=False) if UPDATE in models else None
    if cluster not in (INITIAL, OWN, MAJORITY) and not 0 <= cluster < n_clusters:
        raise ValueError(f"it trained cluster {cluster}, this run has {n_clusters}")
    if cluster == MAJORITY:
        _check_majority(metrics, update is not None, num_classes)
    if update is not None:
        update.flags.writeable = False  # every path alike: TrainReply.update is read-only
        if not np.isfinite(update).all():
            raise ValueError("its update has non-finite values")
    fields = {k: v for k, v in metrics.items() if not isinstance(v, bytes)}  # not the update
    batch, steps = known_number(metrics, "batch-size"), known_number(metrics, "steps")
    variance = None
    if batch is not None and steps is not None and batch > 0 and steps >= 0:
        variance = dp_noise_variance(numbers[2], clip_norm, 1.0, batch, steps)
    return TrainReply(cluster, update, fields, variance)


def _check_majority(metrics: Mapping[str, Any], has_update: bool, num_classes: int) -> None:
    """A majority round's reply: a class of the run, and no update (nothing was trained)."""
    label = known_number(metrics, "majority-class")
    if label is None or label != int(label) or not 0 <= label < num_classes:
        raise ValueError(f"a majority round must name a class 0..{num_classes - 1}, got "
                         f"{metrics.get('majority-class')!r}")
    if has_update:
        raise ValueError("a majority round trains nothing, but the reply carries an update")


@dataclass(frozen=True)
class EvaluateReply:
    """A silo's checked evaluate reply: test accuracy (a fraction; noisy with private
    metrics, possibly outside [0, 1]), mean test loss (nats), its spend, and the figures
    read from its per-class sums (docs/privacy.md#private-evaluation-metrics): balanced
    accuracy (None: no class present) and, for two classes, AUROC (None otherwise, or when
    a class is absent)."""

    accuracy: float
    loss: float
    epsilon_spent: float
    balanced_accuracy: float | None
    auroc: float | None


def evaluate_reply(message: Message, num_classes: int) -> EvaluateReply:
    """A silo's evaluate reply, checked whole (:func:`~..protocol.evaluation_of`): the run's
    ``num_classes`` fixes how many per-class figures it must carry. ValueError says why a
    reply cannot be used."""
    metrics, (spent,) = reply_numbers(message, ("epsilon-spent",))
    sums = evaluation_of(metrics, num_classes)
    area = None if sums.score_histogram is None else auroc(
        sums.score_histogram, sums.class_count, sums.noise_std)
    # accuracy and loss as sent (not back from the sums, whose products may round)
    return EvaluateReply(number(metrics, "test-accuracy"), number(metrics, "test-loss"), spent,
                         balanced_accuracy(sums.class_correct, sums.class_count,
                                           sums.noise_std), area)


def far_off_updates(replies: Mapping[int, TrainReply],
                    ratio: float = MAX_NORM_RATIO) -> dict[int, float]:
    """The silos (keys of ``replies``) whose update's norm is more than ``ratio`` times the
    median norm of the round's updates, with that multiple: one silo's arithmetic gone wrong,
    or a silo that wants the clustering to itself. None with fewer than 3 updates (no median
    to stand for the others) or when the median norm is 0. A norm past float32's range counts
    as infinitely far off."""
    with np.errstate(over="ignore"):  # such a norm is inf, which the test below catches
        norms = {key: float(np.linalg.norm(reply.update)) for key, reply in replies.items()
                 if reply.update is not None}
    if len(norms) < 3:
        return {}
    median = float(np.median(list(norms.values())))
    if not median > 0:
        return {}
    return {key: norm / median for key, norm in norms.items() if norm > ratio * median}
