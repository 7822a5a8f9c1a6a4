"""The registry's ``mlp``: a multi-layer perceptron for tables (records of a few features).

Each record, of the schema's input shape, is flattened to d = prod(input shape) features; then
``hidden`` Linear + ReLU layers and a linear classifier producing C logits. Parameters:
d h_1 + h_1 + sum_k (h_k h_{k+1} + h_{k+1}) + h_last C + C. No BatchNorm (it mixes the records
of a batch, so it has no per-record gradient) and only Linear layers, so DP-SGD runs on the
layerwise engine. ``hidden = ""`` leaves no hidden layer: multinomial logistic regression.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import nn

from ..config.validation import ConfigModel
from .params import Widths


class MLPParams(ConfigModel):
    """The MLP's parameters (run config ``model-params.hidden``)."""

    hidden: Widths = Field((64, 64), description="units of each hidden layer, e.g. '64,64'")


class MLP(nn.Module):
    """Flatten, then Linear + ReLU per hidden width, then the ``classifier`` Linear layer
    (the name ``trainable = "classifier"`` fine-tunes)."""

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for units in hidden:
            layers += [nn.Linear(width, units), nn.ReLU()]
            width = units
        self.hidden = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.hidden(torch.flatten(x, 1)))

    def layer_chain(self) -> list[nn.Module]:
        """The layers whose composition is :meth:`forward`: DP-SGD then runs this model's
        backward pass by hand (:mod:`dpcfl_flwr.dpsgd.layer_chain`), without autograd."""
        return [nn.Flatten(), *self.hidden, self.classifier]


def build_mlp(num_classes: int, input_shape: tuple[int, ...], params: MLPParams) -> MLP:
    """The registry's builder: any input shape, flattened."""
    return MLP(math.prod(input_shape), num_classes, params.hidden)
