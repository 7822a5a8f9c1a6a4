"""The messages between the ServerApp and the silos' ClientApps, in one place.

Three kinds, one record layout each, Flower records only: ``query`` (reply ``silo``),
``train`` (``config`` with the round's settings, the run's whole DP schedule and the packed
models; reply ``metrics`` with the packed ``update``) and ``evaluate`` (reply ``metrics``).
Every field, the cluster codes (:data:`SELECT`, :data:`OWN`, the strategies' ``INITIAL``), the
error codes (:data:`BUDGET_EXCEEDED`, :data:`SILO_FAILED`, :data:`BAD_REQUEST`,
:data:`ROUND_REPEATED`) and the packed
model format (:func:`pack`) are documented in docs/protocol.md; what a silo accepts is
validated in :mod:`dpcfl_flwr.silo.requests`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from .flower_compat import array_chunk_size
from .privacy.metrics import SCORE_BINS, EvaluationSums

ARRAYS = "arrays"
CONFIG = "config"
UPDATE = "update"
METRICS = "metrics"
SILO = "silo"
ANCHOR = "anchor"
CLUSTER_PREFIX = "cluster-"
PACKED = "packed"
OWN_MODEL = "own-model"
SELECT = -1
#: Train / evaluate the silo's own model, kept in its state (Local); no weights are sent.
OWN = -3
#: Predict one class for every record, the silo's most common training label chosen
#: privately (the majority baseline); no weights are sent either way.
MAJORITY = -4

#: Error code of a silo refusing a round that would exceed its privacy budget.
BUDGET_EXCEEDED = 4001
#: Error code of a silo that could not run the round (bad data, bad config).
SILO_FAILED = 4002
#: Error code of a silo refusing a message with a missing or invalid field (named in the
#: reason); nothing was computed or charged.
BAD_REQUEST = 4003
#: Error code of a silo asked again for a round of a run it already trained (or evaluated
#: with private metrics) and charged: a run the server resumed after the round's first
#: message had reached the silo. The silo takes part in the run's next rounds.
ROUND_REPEATED = 4004
#: Flower's error codes of a reply the SuperLink writes itself because the silo gave none:
#: the message expired (3), its reply expired (4), or the node is offline (5). Wire values
#: of Flower's message protocol (its ``ErrorCode``), checked against it in the tests.
NOT_ANSWERED = frozenset({3, 4, 5})


def cluster_key(cluster: int) -> str:
    return f"{CLUSTER_PREFIX}{cluster}"


def arrays_from_vector(vector: np.ndarray, layout: ModelLayout) -> ArrayRecord:
    """Named tensors: for results a person or Flower's own tools read, not for the wire."""
    return ArrayRecord({k: Array(v) for k, v in layout.unflatten(vector).items()})


#: A model on the wire: its packed bytes (a field of the message's ConfigRecord), or (above one
#: chunk, and from named senders) an ArrayRecord of its own.
WireModel = bytes | ArrayRecord

#: Byte order and type of a packed model, fixed by the protocol (bytes carry no dtype).
WIRE_DTYPE = np.dtype("<f4")


def pack(vector: np.ndarray) -> WireModel:
    """A model's flat vector as messages carry it: bytes while it fits in one of Flower's array
    chunks, Flower's chunked Array in a record of its own above that."""
    data = np.ascontiguousarray(vector, dtype=WIRE_DTYPE)
    if data.nbytes <= array_chunk_size():
        return data.tobytes()
    return ArrayRecord({PACKED: Array(data)})


def pack_state(state: Mapping[str, torch.Tensor]) -> WireModel:
    return pack(torch.cat([t.detach().reshape(-1).float() for t in state.values()]).numpy())


def one_record(key: str, fields: Mapping[str, Any],
               models: Mapping[str, WireModel] | None = None) -> RecordDict:
    """A message's content: ``fields`` and the packed ``models`` in one ConfigRecord ``key``
    (one object for Flower to move); a model too large for that in an ArrayRecord of its own
    under its name."""
    record: dict[str, Any] = dict(fields)
    content = RecordDict()
    for name, model in (models or {}).items():
        if name in record:
            raise ValueError(f"model {name!r} would overwrite a field of the {key!r} record")
        if isinstance(model, bytes):
            record[name] = model
        else:
            content[name] = model
    content[key] = ConfigRecord(record)
    return content


def model_records(content: RecordDict) -> dict[str, WireModel]:
    """The models a message carries, by name: the bytes fields of its ConfigRecords and its
    ArrayRecords."""
    models: dict[str, WireModel] = {}
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            models[key] = record
        elif isinstance(record, ConfigRecord):
            models.update((name, value) for name, value in record.items()
                          if isinstance(value, bytes))
    return models


def _packed_vector(model: WireModel, size: int,
                   writable: bool = True) -> np.ndarray | ArrayRecord:
    """The vector of a packed model (checked against the model's size), or the record of a
    named one. ``writable=False`` lets a packed model in native float32 be a read-only view
    of the message's bytes rather than a copy (the server's update checks: at 1,008 silos
    the copies' first touch of fresh memory cost ~0.45 s of round 1 on this project's VM)."""
    if isinstance(model, bytes):
        if len(model) % WIRE_DTYPE.itemsize:
            raise ValueError(f"packed model must be float32 bytes, got {len(model)} bytes")
        vector = np.frombuffer(model, dtype=WIRE_DTYPE)
        if writable or vector.dtype != np.float32:
            vector = vector.astype(np.float32)  # writable, native
    elif isinstance(model, ArrayRecord):
        if list(model.keys()) != [PACKED]:
            return model
        vector = model[PACKED].numpy().reshape(-1)
    else:
        raise ValueError(f"a model must be packed float32 bytes or an ArrayRecord, got a "
                         f"{type(model).__name__}")
    if vector.shape[0] != size:
        raise ValueError(f"packed model has {vector.shape[0]} values, the model {size}")
    return vector


def unpack_state(model: WireModel, template: Mapping[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as ``template`` (a state dict of the same model)."""
    size = sum(t.numel() for t in template.values())
    vector = _packed_vector(model, size)
    if isinstance(vector, ArrayRecord):
        return _named_state(vector, template)
    flat, out, start = torch.from_numpy(vector.copy()), {}, 0
    for name, like in template.items():
        out[name] = flat[start:start + like.numel()].reshape(like.shape).to(like.dtype)
        start += like.numel()
    return out


def _named_state(record: ArrayRecord, template: Mapping[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """A named model's tensors, checked name by name against ``template`` (names in order,
    shapes, floating dtypes) before any is converted: a wrong layout is a ValueError naming
    the first difference, never an error deep inside ``load_state_dict``."""
    names, expected = list(record.keys()), list(template)
    if names != expected:
        extra = sorted(set(names) - set(expected))[:3]
        missing = sorted(set(expected) - set(names))[:3]
        raise ValueError(f"its tensors are not the model's (unexpected {extra or 'none'}, "
                         f"missing {missing or 'none'}, or another order)")
    state = {}
    for name, like in template.items():
        declared = record[name]
        if tuple(declared.shape) != tuple(like.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(declared.shape)}, the model's "
                             f"is {tuple(like.shape)}")
        array = declared.numpy()
        if array.shape != tuple(like.shape) or array.dtype.kind != "f":
            raise ValueError(f"tensor {name!r} holds {array.dtype} {array.shape}, the model's "
                             f"is float {tuple(like.shape)}")
        state[name] = torch.from_numpy(array.copy()).to(like.dtype)
    return state


class ModelLayout:
    """Names and shapes of a model's tensors, to move between ArrayRecords and flat vectors
    (the server aggregates and clusters flat float32 vectors)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> None:
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.size = sum(self.sizes)

    @classmethod
    def of(cls, record: ArrayRecord) -> ModelLayout:
        arrays = record.to_numpy_ndarrays()
        return cls(list(record.keys()), [a.shape for a in arrays])

    def flatten(self, model: WireModel, writable: bool = True) -> np.ndarray:
        """The model as one float32 vector; ``writable=False``: possibly a read-only view of
        its packed bytes (see :func:`_packed_vector`)."""
        record = _packed_vector(model, self.size, writable)
        if not isinstance(record, ArrayRecord):
            return record.astype(np.float32, copy=False)
        if list(record.keys()) != self.names:
            raise ValueError("array record does not have the model's tensors")
        return np.concatenate(
            [a.astype(np.float32, copy=False).reshape(-1) for a in record.to_numpy_ndarrays()]
        )

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        if vector.shape != (self.size,):
            raise ValueError(f"expected a vector of {self.size} values, got {vector.shape}")
        out, start = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[name] = vector[start:start + size].reshape(shape)
            start += size
        return out


def number(record: Mapping[str, Any], key: str) -> float:
    """A numeric field of a record (records are typed as unions of scalars and lists)."""
    value = record[key]
    if isinstance(value, bool | int | float):
        return float(value)
    raise ValueError(f"record field {key!r} must be a number, got {value!r}")


def integer(record: Mapping[str, Any], key: str) -> int:
    return int(number(record, key))


def batch_of(record: Mapping[str, Any], key: str) -> int | Literal["full"]:
    """A batch size field: ``"full"`` or a positive integer (sent as text)."""
    text = str(record[key])
    return "full" if text == "full" else int(text)


def metric_record(values: Mapping[str, float | int | list[float]]) -> MetricRecord:
    return MetricRecord(cast(dict[str, Any], dict(values)))


def evaluation_fields(sums: EvaluationSums) -> dict[str, Any]:
    """The figures of an evaluate reply (docs/protocol.md#evaluate) from a test split's sums:
    ``num-examples``, ``test-loss``, ``test-accuracy``, per true class ``class-correct`` and
    ``class-count``, for two classes ``score-histogram`` (class 0's bins, then class 1's),
    and ``metrics-noise-std`` (the noise's standard deviation on each sum; 0: exact)."""
    fields: dict[str, Any] = {
        "num-examples": sums.count, "test-loss": float(sums.loss),
        "test-accuracy": float(sums.accuracy),
        "class-correct": [float(v) for v in sums.class_correct],
        "class-count": [float(v) for v in sums.class_count],
        "metrics-noise-std": float(sums.noise_std)}
    if sums.score_histogram is not None:
        fields["score-histogram"] = [float(v) for v in sums.score_histogram.reshape(-1)]
    return fields


def evaluation_of(record: Mapping[str, Any], num_classes: int) -> EvaluationSums:
    """An evaluate reply's figures as sums (:func:`evaluation_fields` read back), checked
    whole: every number finite, ``num-examples`` a positive integer, the noise's deviation
    >= 0, one entry per class of the run (``num_classes``) and, exactly when it has two
    classes, 2 x SCORE_BINS histogram bins. ValueError naming the first field at fault."""
    missing = [key for key in ("num-examples", "test-accuracy", "test-loss",
                               "metrics-noise-std") if key not in record]
    if missing:
        raise ValueError(f"no '{missing[0]}' in the reply")
    count = number(record, "num-examples")
    if not (count >= 1 and count == int(count)):
        raise ValueError(f"'num-examples' must be a positive integer, got {count}")
    numbers = {key: number(record, key) for key in ("test-accuracy", "test-loss",
                                                     "metrics-noise-std")}
    if not all(math.isfinite(v) for v in numbers.values()) or numbers["metrics-noise-std"] < 0:
        raise ValueError(f"its figures must be finite and the noise's deviation >= 0, got "
                         f"{numbers}")
    lengths = {"class-correct": num_classes, "class-count": num_classes}
    if num_classes == 2:
        lengths["score-histogram"] = 2 * SCORE_BINS
    elif "score-histogram" in record:
        raise ValueError(f"'score-histogram' is for two classes; this run has {num_classes}")
    lists = {key: _numbers(record, key, size) for key, size in lengths.items()}
    histogram = lists.get("score-histogram")
    return EvaluationSums(
        int(count), numbers["test-accuracy"] * count, numbers["test-loss"] * count,
        lists["class-correct"], lists["class-count"],
        None if histogram is None else histogram.reshape(2, SCORE_BINS),
        numbers["metrics-noise-std"])


def _numbers(record: Mapping[str, Any], key: str, size: int) -> np.ndarray:
    """A list field of ``size`` finite numbers."""
    if key not in record:
        raise ValueError(f"no '{key}' in the reply")
    value = record[key]
    if not isinstance(value, list) or len(value) != size:
        raise ValueError(f"'{key}' must be a list of {size} numbers")
    array = np.asarray([v if isinstance(v, int | float) and not isinstance(v, bool)
                        else math.nan for v in value], dtype=np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"'{key}' must hold finite numbers only")
    return array


def config_of(message: Message) -> ConfigRecord:
    return message.content.config_records[CONFIG]


def metrics_of(message: Message, key: str = METRICS) -> Mapping[str, Any]:
    """A reply's record of numbers: a MetricRecord, or the ConfigRecord of a train reply (it
    also carries the update)."""
    record = message.content[key]
    if not isinstance(record, ConfigRecord | MetricRecord):
        raise ValueError(f"the reply's {key!r} is a {type(record).__name__}, not numbers")
    return record


def reply(message: Message, content: RecordDict) -> Message:
    return Message(content, reply_to=message)
