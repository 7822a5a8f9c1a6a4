"""The messages between the ServerApp and the silos' ClientApps, in one place.

One record layout per message kind (Flower records only, no loose dicts):

``query`` (server -> silo, once before round 1)
    config: ``server-round`` = 0
  reply ``silo`` (MetricRecord): ``partition-id``, ``true-cluster`` (-1 if unknown; used for
    evaluation and the oracle only), ``num-train``, ``epsilon-budget``, ``delta``,
    ``epsilon-spent``

``train`` (server -> silo, every round)
    ``arrays`` (a packed model, see below): the one model to train, or ``cluster-0`` ..
    ``cluster-{M-1}`` when the silo must privately select one (stage 3 of R-DPCFL, IFCA);
    ``config`` (ConfigRecord): ``server-round``, ``stage``, ``cluster`` (-1 = select),
    ``round-batch`` ("full" or the batch size), the whole schedule the silo calibrates its
    noise for (``rounds``, ``local-epochs``, ``batch-size``, ``first-batch``,
    ``select-rounds``, ``select-ratio``, ``conversion``, ``budget-mode``, ``schedule``) and
    ``learning-rate``, ``clip-norm``; MR-MTL adds ``prox-lambda``, ``prox-variant`` and the
    ``anchor`` model; Local sends ``personal`` = 1 (keep the trained model, reply
    without an update) and, after round 1, no weights at all (``cluster`` = -3, own model).
  reply ``update`` (packed: trained minus received weights) and ``metrics``
    (MetricRecord): ``num-examples``, ``cluster`` (trained), ``selected`` (0/1),
    ``val-loss``, ``val-accuracy``, ``epsilon-spent``, ``noise-multiplier``,
    ``cpu-seconds`` (CPU time inside the handler, for the framework-overhead benchmark:
    wall time would count the waits of silos sharing cores);
  or an Error with code :data:`BUDGET_EXCEEDED` when the round would overspend.

Every model (``arrays``, ``cluster-m``, ``anchor``, ``update``) travels packed (:func:`pack`):
its tensors in state-dict order as one little-endian float32 vector; both ends know the model,
so names and shapes need not travel. Flower moves every record, Array and chunk of a message as
a separate object, one request each way (signed and verified under node authentication), and a
request costs the SuperNode and the SuperLink far more than the bytes it carries at these
sizes. A model that fits in one of Flower's array chunks (5 MiB: the CNN, not ResNet-18) is
therefore the ``bytes`` value ``packed`` of a ConfigRecord (one object); a larger one is an
ArrayRecord with one Array ``packed`` (Flower's own chunking, 3 objects and up). Counting the
message and its config record, the CNN's six named tensors made a one-model train message 16
objects and a four-candidate one 55; packed they are 4 and 7. Named ArrayRecords are still
read.

``evaluate`` (server -> silo)
    ``arrays``: the model the silo would use; ``config``: ``server-round``, ``cluster``
  reply ``metrics``: ``num-examples``, ``test-loss``, ``test-accuracy``, ``cluster``,
    ``epsilon-spent``
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

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

#: Error code of a silo refusing a round that would exceed its privacy budget.
BUDGET_EXCEEDED = 4001
#: Error code of a silo that could not run the round (bad data, bad config).
SILO_FAILED = 4002


def cluster_key(cluster: int) -> str:
    return f"{CLUSTER_PREFIX}{cluster}"


def arrays_from_vector(vector: np.ndarray, layout: ModelLayout) -> ArrayRecord:
    """Named tensors: for results a person or Flower's own tools read, not for the wire."""
    return ArrayRecord({k: Array(v) for k, v in layout.unflatten(vector).items()})


#: A model on the wire: a ConfigRecord holding its packed bytes, or (above one chunk, and
#: from named senders) an ArrayRecord.
WireModel = ArrayRecord | ConfigRecord

#: Byte order and type of a packed model, fixed by the protocol (bytes carry no dtype).
WIRE_DTYPE = np.dtype("<f4")


def pack(vector: np.ndarray) -> WireModel:
    """A model's flat vector as the record messages carry: one object while it fits in one of
    Flower's array chunks, Flower's chunked Array above that."""
    data = np.ascontiguousarray(vector, dtype=WIRE_DTYPE)
    if data.nbytes <= FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE:
        return ConfigRecord({PACKED: data.tobytes()})
    return ArrayRecord({PACKED: Array(data)})


def pack_state(state: Mapping[str, torch.Tensor]) -> WireModel:
    return pack(torch.cat([t.detach().reshape(-1).float() for t in state.values()]).numpy())


def model_records(content: RecordDict) -> dict[str, WireModel]:
    """The models a message carries, by key: every ArrayRecord and every packed ConfigRecord
    (the ``config`` record and other settings are not models)."""
    return {key: record for key, record in content.items()
            if isinstance(record, ArrayRecord)
            or (isinstance(record, ConfigRecord) and list(record.keys()) == [PACKED])}


def _packed_vector(record: WireModel, size: int) -> np.ndarray | None:
    """The vector of a packed record (checked against the model's size), None if named."""
    if list(record.keys()) != [PACKED]:
        return None
    value = record[PACKED]
    if isinstance(value, Array):
        vector = value.numpy().reshape(-1)
    elif isinstance(value, bytes):
        if len(value) % WIRE_DTYPE.itemsize:
            raise ValueError(f"packed model must be float32 bytes, got {len(value)} bytes")
        vector = np.frombuffer(value, dtype=WIRE_DTYPE).astype(np.float32)  # writable, native
    else:
        raise ValueError(f"packed model must be float32 bytes or an Array, got a "
                         f"{type(value).__name__}")
    if vector.shape[0] != size:
        raise ValueError(f"packed model has {vector.shape[0]} values, the model {size}")
    return vector


def unpack_state(record: WireModel, template: Mapping[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as ``template`` (a state dict of the same model)."""
    size = sum(t.numel() for t in template.values())
    vector = _packed_vector(record, size)
    if vector is None:
        return _named(record).to_torch_state_dict()
    flat, out, start = torch.from_numpy(vector.copy()), {}, 0
    for name, like in template.items():
        out[name] = flat[start:start + like.numel()].reshape(like.shape).to(like.dtype)
        start += like.numel()
    return out


def _named(record: WireModel) -> ArrayRecord:
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"a model record holds {sorted(record.keys())}, not a packed model")
    return record


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

    def flatten(self, record: WireModel) -> np.ndarray:
        packed = _packed_vector(record, self.size)
        if packed is not None:
            return packed.astype(np.float32, copy=False)
        record = _named(record)
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


def metric_record(values: Mapping[str, float | int]) -> MetricRecord:
    return MetricRecord(cast(dict[str, Any], dict(values)))


def config_of(message: Message) -> ConfigRecord:
    return message.content.config_records[CONFIG]


def metrics_of(message: Message, key: str = METRICS) -> MetricRecord:
    return message.content.metric_records[key]


def reply(message: Message, content: RecordDict) -> Message:
    return Message(content, reply_to=message)
