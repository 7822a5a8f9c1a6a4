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

    @property
    def warnings(self) -> list[str]:
        """What will likely train badly although the records fit: inputs on a scale the
        default step size was not made for, too few records for a few batches, a label most
        records share (one line each; shown locally only)."""
        said = []
        low, high, _ = self.value_range
        if max(abs(low), abs(high)) > INPUT_SCALE:
            said.append(f"input values reach {max(abs(low), abs(high)):.4g}: inputs far outside "
                        f"[-{INPUT_SCALE:g}, {INPUT_SCALE:g}] make a learning rate chosen for "
                        "scaled inputs step too far; scale them (pixels / 255, a table's "
                        "number(mean,scale))")
        train = self.counts["train"]
        if train < FEW_BATCHES * TYPICAL_BATCH:
            said.append(f"{train} training records: fewer than {FEW_BATCHES} batches of "
                        f"{TYPICAL_BATCH}; DP noise weighs more on few records")
        total = sum(self.class_counts)
        if total and max(self.class_counts) > IMBALANCE * total:
            top = max(range(len(self.class_counts)), key=self.class_counts.__getitem__)
            said.append(f"class {top} holds {100 * self.class_counts[top] / total:.0f}% of the "
                        "training records: accuracy near that share is what always guessing "
                        "it scores; read balanced accuracy")
        return said


#: Largest input magnitude taken without a warning: standardised features and pixels scaled
#: to [0, 1] (and normalised) stay well inside it; raw pixels (0..255) do not.
INPUT_SCALE = 10.0
#: Training records below FEW_BATCHES batches of TYPICAL_BATCH (the default batch size) warn.
FEW_BATCHES, TYPICAL_BATCH = 4, 32
#: A label holding more than this share of the training records warns.
IMBALANCE = 0.8


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
