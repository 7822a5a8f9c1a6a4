"""What a silo operator sees of their own records (``dpcfl data check``), on their own machine.

These figures are statistics of the records (counts per class, value ranges): they are shown
locally and never sent anywhere; a silo releases only N_i and what DP covers
(docs/own-data.md#what-is-checked-and-what-the-server-learns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .arrays import check_schema
from .partition import ClientData
from .readers import DataError
from .records import chunks_of
from .schema import Schema


@dataclass(frozen=True)
class RecordsSummary:
    """A silo's records at a glance.

    - ``counts``: records per split (train, val, test);
    - ``record_shape``: one record's shape as the model sees it;
    - ``class_counts``: training records per label 0..C-1 (C from the labels seen, or the
      schema's);
    - ``value_range``: the smallest and largest input value over every split, and the mean
      over the training records;
    - ``problem``: why the records do not fit the schema (one line), None: they fit (or no
      schema was given).
    """

    counts: dict[str, int]
    record_shape: tuple[int, ...]
    class_counts: list[int]
    value_range: tuple[float, float, float]
    problem: str | None


def summarise(data: ClientData, schema: Schema | None, where: str) -> RecordsSummary:
    """The summary of ``data``, checked against ``schema`` when one is given."""
    splits = {"train": (data.x_train, data.y_train), "val": (data.x_val, data.y_val),
              "test": (data.x_test, data.y_test)}
    classes = schema.num_classes if schema else int(data.y_train.max()) + 1
    counts = torch.bincount(data.y_train.clamp(0, classes), minlength=classes + 1)[:classes]
    low, high = math.inf, -math.inf
    for x, _ in splits.values():
        for chunk in chunks_of(x):
            low, high = min(low, float(chunk.min())), max(high, float(chunk.max()))
    train_sum = sum(float(chunk.double().sum()) for chunk in chunks_of(data.x_train))
    train_mean = train_sum / (data.num_train * math.prod(data.x_train.shape[1:]))
    problem = None
    if schema is not None:
        try:
            check_schema(data, schema.input_shape, schema.num_classes, where)
        except DataError as exc:
            problem = str(exc)
    return RecordsSummary({name: len(y) for name, (_, y) in splits.items()},
                          tuple(data.x_train.shape[1:]), counts.tolist(),
                          (low, high, train_mean), problem)
