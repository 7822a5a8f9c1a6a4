"""The models a message carries, as a silo accepts them: every one it will use is unpacked and
checked (this silo's model, finite weights) before any is used, and a selection round's
candidates are counted before any is read (docs/threat-model.md#work-per-message)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..protocol import ARRAYS, CLUSTER_PREFIX, OWN_MODEL, WireModel, cluster_key, unpack_state
from .requests import BadRequest
from .silo import Silo


def received_model(models: Mapping[str, WireModel], name: str, silo: Silo
                   ) -> dict[str, torch.Tensor]:
    """The model ``name`` as the silo's model's tensors; BadRequest if it is missing, not this
    model (size, names, shapes, dtypes), or not finite (NaN weights make every figure NaN)."""
    if name not in models:
        raise BadRequest(f"the message carries no model '{name}'")
    template = silo.template()  # a model this silo cannot build is its failure, not the message's
    try:
        state = unpack_state(models[name], template)
    except (ValueError, KeyError, TypeError, EOFError, OSError) as exc:
        raise BadRequest(f"model '{name}' is not this silo's model: {exc}") from None
    if not all(bool(torch.isfinite(tensor).all()) for tensor in state.values()):
        raise BadRequest(f"model '{name}' has non-finite weights")
    return state


def selection_candidates(models: Mapping[str, WireModel], silo: Silo
                         ) -> list[dict[str, torch.Tensor]]:
    """The cluster models of a selection round: ``cluster-0`` .. ``cluster-{M-1}``, no gaps,
    at most the silo's ``max-candidates``."""
    names = [key for key in models if key.startswith(CLUSTER_PREFIX)]
    limit = silo.silo.max_candidates
    if len(names) > limit:
        raise BadRequest(f"a selection round carries {len(names)} cluster models; this silo "
                         f"scores at most {limit} (node config 'max-candidates')")
    expected = [cluster_key(m) for m in range(len(names))]
    if not names or sorted(names) != sorted(expected):
        raise BadRequest(f"a selection round needs models {CLUSTER_PREFIX}0 .. "
                         f"{CLUSTER_PREFIX}<M-1>, got {sorted(names) or 'none'}")
    return [received_model(models, name, silo) for name in expected]


def start_model(models: Mapping[str, WireModel], silo: Silo) -> dict[str, torch.Tensor]:
    """The weights the server sent (``arrays``), or the silo's own model (``own-model``, which
    the ClientApp adds from the node's state) when it sent none (Local)."""
    if ARRAYS in models:
        return received_model(models, ARRAYS, silo)
    if OWN_MODEL in models:
        return received_model(models, OWN_MODEL, silo)
    raise BadRequest("no model received and no own model kept from an earlier round")
