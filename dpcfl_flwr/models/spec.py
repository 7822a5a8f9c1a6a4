"""One model as a run names it, and the one way it is built (server and every silo).

:class:`ModelSpec` holds what the run config says about the model: its registry name, its
parameters, the schema's classes and record shape, ``model-fix`` and the ``trainable``
prefixes (it is defined in :mod:`.registry`, which needs no torch, so that validating a config
does not import torch). :func:`build` turns it into a module: the registry's builder, Opacus'
check (or fix), then the frozen layers. The server builds it with the run's seed for theta_init
(:func:`initial_state`); a silo builds it from its own installed code and loads the server's
weights into it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..config.validation import ConfigError
from .dp_check import dp_trainable
from .initial_weights import load_initial_weights
from .registry import ModelSpec, model_entry, validate_params
from .trainable import freeze_except

logger = logging.getLogger(__name__)


def build(spec: ModelSpec, seed: int | None = None) -> nn.Module:
    """A fresh model in training mode; ``seed`` makes its initial weights reproducible
    without touching torch's global random state. ConfigError (one line) when the model is
    not installed, its builder raises or returns no module, or DP-SGD cannot train it."""
    entry = model_entry(spec.name)
    params = validate_params(entry, dict(spec.params))
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            model = entry(spec.num_classes, spec.input_shape, params)
        except Exception as exc:  # a plug-in may raise anything: one line, not a traceback
            text = str(exc).strip().splitlines()
            raise ConfigError(f"model {spec.name!r} ({entry.origin}) could not be built for "
                              f"{spec.num_classes} classes and input shape "
                              f"{spec.input_shape}: {type(exc).__name__}: "
                              f"{text[0] if text else '(no message)'}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec.name!r} ({entry.origin}): its builder returned a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    model = dp_trainable(model, spec.name, spec.fix)
    freeze_except(model, spec.trainable, spec.name)
    return model


def build_for_shapes(spec: ModelSpec) -> nn.Module:
    """The model with every tensor on PyTorch's meta device: its names, shapes and forward
    pass without memory for its values, so its size can be known before it is built. A
    plug-in whose builder cannot run there is built for real (logged); ConfigError as
    :func:`build`."""
    try:
        with torch.device("meta"):
            return build(spec)
    except Exception:  # noqa: BLE001 - a plug-in's own limitation: built the costly way
        logger.info("model %r cannot be built on the meta device; built for real to be "
                    "measured", spec.name)
        return build(spec)


def initial_state(spec: ModelSpec, seed: int, weights: str = "") -> dict[str, torch.Tensor]:
    """theta_init: the seeded model's state, or (``weights``, a file path) the file's tensors,
    checked against it."""
    state = build(spec, seed).state_dict()
    return load_initial_weights(weights, state) if weights else state


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters (the coordinates DP-SGD clips and noises). A model update on the
    wire holds every tensor of the state dict; a frozen parameter's coordinates are 0 there."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["ModelSpec", "build", "build_for_shapes", "count_parameters", "initial_state"]
