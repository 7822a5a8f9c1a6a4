"""Input scaling that lets one learning rate serve records stored in any range.

docs/own-data.md#input-scaling says when it applies. A DP-SGD step moves the weights by the
learning rate times clipped gradients, and a first layer's gradients grow with its inputs:
records stored as 0..255 pixels want a learning rate ~255 times smaller than the same
records in [0, 1]. Standardising each record on its own values (mean 0, standard deviation
1) removes that factor without any statistic across records, so nothing about other records
enters a record's input and nothing needs to leave the silo or be agreed beforehand.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .partition import ClientData
from .records import Inputs, LazyRecords
from .schema import Schema

#: The sources whose records are scaled (a table's features are standardised by the
#: schema's own means and scales; a plug-in prepares its own records).
SCALED_SOURCES = frozenset({"arrays", "image-folder"})

#: Added to a record's standard deviation: a constant record (a blank image) maps to zeros.
FLOOR = 1e-6


def standardise_rows(rows: np.ndarray) -> np.ndarray:
    """Each row (a record of any shape) to mean 0 and standard deviation 1 over its values."""
    if len(rows) == 0:  # an absent split (a silo without validation records)
        return rows.astype(np.float32, copy=False)
    flat = rows.reshape(len(rows), -1).astype(np.float32, copy=False)
    mean = flat.mean(axis=1, keepdims=True)
    std = flat.std(axis=1, keepdims=True)
    return ((flat - mean) / (std + FLOOR)).reshape(rows.shape)


def standardised(x: Inputs) -> Inputs:
    """``x``'s records standardised one at a time; records read when used stay so."""
    if isinstance(x, LazyRecords):
        return x.mapped(standardise_rows)
    return torch.from_numpy(standardise_rows(x.numpy()))


def scaled_inputs(data: ClientData, schema: Schema, source: str) -> ClientData:
    """The silo's records as the model sees them: standardised per record where the schema
    asks for it (``input-scaling = "per-record"``, no image-mean / image-std) and the source
    is one of :data:`SCALED_SOURCES`; otherwise unchanged."""
    if (source not in SCALED_SOURCES or schema.image_mean
            or schema.input_scaling != "per-record"):
        return data
    return dataclasses.replace(data, x_train=standardised(data.x_train),
                               x_val=standardised(data.x_val), x_test=standardised(data.x_test))
