"""What one run config may make a silo build, checked before its model exists.

The server names the model, its parameters, the number of classes and the physical batch;
each sizes what the silo allocates (an MLP of hidden widths ``12000,12000`` is 153 M values,
0.6 GB before it trains). So the silo sizes the run's model on PyTorch's meta device (shapes,
no values), estimates a round's peak from it, and refuses a run beyond its own limits (node
config ``max-model-parameters``, ``max-classes``, ``max-physical-batch``,
``max-round-memory``) by name, before any real tensor of the model is made
(docs/threat-model.md#work-per-message).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config.settings import SiloConfig
from ..dpsgd.per_sample import activation_floats
from ..dpsgd.training import chunk_size
from ..models import ModelSpec, build_for_shapes
from .requests import BadRequest

#: Copies of the model's values a round holds at once: the received weights (wire bytes and
#: tensors), the model, its gradient, the clipped sum, the noise, the update and the start.
STATE_COPIES = 8
#: What a physical batch holds per float of a record's activations: the outputs, what
#: autograd keeps for the backward pass, and their gradients.
ACTIVATION_COPIES = 3
#: Bytes of a float32 value.
FLOAT_BYTES = 4


@dataclass(frozen=True)
class Footprint:
    """The size of a run's model: ``values`` of its state (parameters and buffers),
    ``trainable`` values, ``activations`` (floats of one record's forward outputs) and the
    ``physical_batch`` (records whose per-sample gradients are held at once)."""

    values: int
    trainable: int
    activations: int
    physical_batch: int

    @property
    def peak_mib(self) -> float:
        """A round's estimated peak of model and training memory (MiB): the model's state
        copies, and a physical batch of per-sample gradients (materialised: the largest an
        engine holds) with its activations."""
        per_record = self.trainable + ACTIVATION_COPIES * self.activations
        floats = STATE_COPIES * self.values + self.physical_batch * per_record
        return FLOAT_BYTES * floats / 2**20


@functools.lru_cache(maxsize=8)
def footprint(spec: ModelSpec, physical_batch_size: int) -> Footprint:
    """The footprint of ``spec`` trained in physical batches of ``physical_batch_size``
    records (0: the silo's memory rule, :func:`~..dpsgd.training.chunk_size`). A model
    plug-in whose builder cannot run on the meta device is built for real to be measured."""
    model = build_for_shapes(spec)
    device = next((t.device for t in model.state_dict().values()), torch.device("meta"))
    values = sum(t.numel() for t in model.state_dict().values())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        activations = activation_floats(model, torch.empty((1, *spec.input_shape),
                                                           device=device))
    except Exception:  # noqa: BLE001 - unmeasurable activations count as a record's input
        activations = int(torch.Size(spec.input_shape).numel())
    return Footprint(values, trainable, activations,
                     chunk_size(model, physical_batch_size or None))


def refuse_beyond_limits(spec: ModelSpec, physical_batch_size: int, silo: SiloConfig
                         ) -> None:
    """BadRequest naming the run-config key and the silo's limit it exceeds: classes and
    physical batch first (no model needed), then the model's values and a round's
    estimated memory, measured on the meta device."""
    asked = (("num-classes", spec.num_classes, silo.max_classes, "max-classes"),
             ("physical-batch-size", physical_batch_size, silo.max_physical_batch,
              "max-physical-batch"))
    for key, value, limit, name in asked:
        if value > limit:
            raise BadRequest(f"run config: '{key}' = {value} exceeds this silo's limit of "
                             f"{limit} (node config '{name}')")
    size = footprint(spec, physical_batch_size)
    if size.values > silo.max_model_parameters:
        raise BadRequest(f"run config: model {spec.name!r} with its model-params holds "
                         f"{size.values:,} values; this silo builds at most "
                         f"{silo.max_model_parameters:,} (node config 'max-model-parameters')")
    if size.peak_mib > silo.max_round_memory:
        raise BadRequest(f"run config: a round of model {spec.name!r} in physical batches of "
                         f"{size.physical_batch} records needs an estimated "
                         f"{size.peak_mib:,.0f} MiB; this silo allows {silo.max_round_memory} "
                         "MiB (node config 'max-round-memory')")
