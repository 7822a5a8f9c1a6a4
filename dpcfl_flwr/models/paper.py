"""The paper's models (docs/experiments.md#models), trainable with per-sample gradients.

- ``cnn``: two 5x5 conv + max-pool blocks and one linear layer producing logits
  (28,938 parameters for 28x28 records; the authors' code has no activation after the last
  layer). Parameters: ``channels`` of the two blocks (16,32).
- ``resnet18``: ResNet-18 (7x7 stem, BasicBlocks [2, 2, 2, 2]) with every BatchNorm replaced by
  GroupNorm, because BatchNorm mixes samples and so has no per-sample gradient (11,181,642
  parameters for 10 classes). Parameters: ``groups`` of every GroupNorm (2).
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator
from torch import nn

from ..config.validation import ConfigModel
from .params import Widths

GROUPNORM_GROUPS = 2


class CNNParams(ConfigModel):
    """The CNN's parameters (run config ``model-params.channels``)."""

    channels: Widths = Field((16, 32), description="output channels of the two conv blocks")

    @field_validator("channels")
    @classmethod
    def _two_blocks(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(value) != 2:
            raise ValueError("the CNN has two conv blocks: give two widths, e.g. '16,32'")
        return value


class PaperCNN(nn.Module):
    """The MNIST/FMNIST CNN of [003] Table 1 (28x28 inputs; other sizes change only the
    linear layer's inputs: channels x (height // 4) x (width // 4))."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1,
                 channels: tuple[int, int] = (16, 32), size: tuple[int, int] = (28, 28)) -> None:
        super().__init__()
        first, second = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, first, kernel_size=5, stride=1, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(first, second, kernel_size=5, stride=1, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(second * (size[0] // 4) * (size[1] // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class ResNetParams(ConfigModel):
    """ResNet-18-GN's parameters (run config ``model-params.groups``)."""

    groups: int = Field(GROUPNORM_GROUPS, ge=1,
                        description="groups of every GroupNorm; must divide 64")

    @field_validator("groups")
    @classmethod
    def _divides_widths(cls, value: int) -> int:
        if 64 % value:
            raise ValueError("must divide 64 (every stage's width is a multiple of 64)")
        return value


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int,
                 groups: int = GROUPNORM_GROUPS) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.GroupNorm(groups, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 for 10 classes with GroupNorm, as the authors ran it on CIFAR-10."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3,
                 groups: int = GROUPNORM_GROUPS) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
            nn.GroupNorm(groups, 64),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        widths, blocks, layers = (64, 128, 256, 512), 2, []
        in_channels = 64
        for stage, width in enumerate(widths):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, width, stride, groups))
                in_channels = width
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.GroupNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def build_cnn(num_classes: int, input_shape: tuple[int, ...], params: CNNParams) -> PaperCNN:
    """The registry's ``cnn``: records of shape (channels, height, width), at least 4x4."""
    if len(input_shape) != 3 or min(input_shape[1:]) < 4:
        raise ValueError(f"the CNN needs records of shape channels,height,width of at least "
                         f"4x4; the schema's input shape is {input_shape}")
    first, second = params.channels
    return PaperCNN(num_classes, input_shape[0], (first, second),
                    (input_shape[1], input_shape[2]))


def build_resnet18(num_classes: int, input_shape: tuple[int, ...],
                   params: ResNetParams) -> ResNet18GN:
    """The registry's ``resnet18``: records of shape (channels, height, width), any size."""
    if len(input_shape) != 3:
        raise ValueError(f"ResNet-18 needs records of shape channels,height,width; the "
                         f"schema's input shape is {input_shape}")
    return ResNet18GN(num_classes, input_shape[0], params.groups)
