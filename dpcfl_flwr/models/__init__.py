"""Models a run can name: the registry (built-ins and installed plug-ins), their parameters,
and the one way server and silos build them (docs/own-data.md#models).

- :mod:`.registry`: names, builders, entry points, parameter validation, :class:`ModelSpec`;
- :mod:`.paper` (``cnn``, ``resnet18``) and :mod:`.mlp` (``mlp``): the built-ins;
- :mod:`.spec`: :func:`build`, the one way a :class:`ModelSpec` becomes a module;
- :mod:`.dp_check`, :mod:`.trainable`, :mod:`.initial_weights`: Opacus' check, frozen layers,
  a pretrained start.

The names that need torch are imported on first use (PEP 562): validating a config needs only
the registry, and the silo supervisor (``dpcfl client``), which never trains, would otherwise
hold some 300 MB of torch for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .registry import ENTRY_POINT_GROUP, ModelSpec, model_names

if TYPE_CHECKING:
    from torch import nn

    from .mlp import MLP, MLPParams
    from .paper import GROUPNORM_GROUPS, BasicBlock, PaperCNN, ResNet18GN
    from .spec import build, build_for_shapes, count_parameters, initial_state

#: The paper's image models (the audit and attack commands take these).
MODEL_NAMES = ("cnn", "resnet18")

#: Where each name that needs torch is defined, imported when first asked for.
_TORCH_NAMES = {
    "MLP": ".mlp", "MLPParams": ".mlp",
    "GROUPNORM_GROUPS": ".paper", "BasicBlock": ".paper", "PaperCNN": ".paper",
    "ResNet18GN": ".paper",
    "build": ".spec", "build_for_shapes": ".spec", "count_parameters": ".spec",
    "initial_state": ".spec",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module(_TORCH_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def image_model_spec(name: str, num_classes: int = 10, in_channels: int | None = None
                     ) -> ModelSpec:
    """An image model of the registry with its default parameters, for the benchmarks'
    records: ``in_channels`` x 28 x 28 (``cnn``; default 1 channel) or x 32 x 32 (others;
    default 3)."""
    channels = in_channels if in_channels is not None else (1 if name == "cnn" else 3)
    size = 28 if name == "cnn" else 32
    return ModelSpec(name, num_classes, (channels, size, size))


def build_model(name: str, num_classes: int = 10, in_channels: int | None = None,
                seed: int | None = None) -> nn.Module:
    """A fresh image model (:func:`image_model_spec`); ``seed`` makes the initial weights
    (theta_init) reproducible."""
    from .spec import build  # noqa: PLC0415 (torch, only when a model is built)

    return build(image_model_spec(name, num_classes, in_channels), seed)


__all__ = ["ENTRY_POINT_GROUP", "GROUPNORM_GROUPS", "MLP", "MODEL_NAMES", "BasicBlock",
           "MLPParams", "ModelSpec", "PaperCNN", "ResNet18GN", "build", "build_model",
           "build_for_shapes", "count_parameters", "image_model_spec", "initial_state",
           "model_names"]
