"""Models a run can name: the registry (built-ins and installed plug-ins), their parameters,
and the one way server and silos build them (docs/own-data.md#models).

- :mod:`.registry`: names, builders, entry points, parameter validation;
- :mod:`.paper` (``cnn``, ``resnet18``) and :mod:`.mlp` (``mlp``): the built-ins;
- :mod:`.spec`: a run's model (:class:`ModelSpec`) and :func:`build`;
- :mod:`.dp_check`, :mod:`.trainable`, :mod:`.initial_weights`: Opacus' check, frozen layers,
  a pretrained start.
"""

from __future__ import annotations

from torch import nn

from .mlp import MLP, MLPParams
from .paper import GROUPNORM_GROUPS, BasicBlock, PaperCNN, ResNet18GN
from .registry import ENTRY_POINT_GROUP, model_names
from .spec import ModelSpec, build, count_parameters, initial_state

#: The paper's image models (the audit and attack commands take these).
MODEL_NAMES = ("cnn", "resnet18")


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
    return build(image_model_spec(name, num_classes, in_channels), seed)


__all__ = ["ENTRY_POINT_GROUP", "GROUPNORM_GROUPS", "MLP", "MODEL_NAMES", "BasicBlock",
           "MLPParams", "ModelSpec", "PaperCNN", "ResNet18GN", "build", "build_model",
           "count_parameters", "image_model_spec", "initial_state", "model_names"]
