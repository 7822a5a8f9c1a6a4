"""The paper's models (docs/experiments.md#models), trainable with per-sample gradients.

- ``cnn``: two 5x5 conv + max-pool blocks and one linear layer producing logits
  (28,938 parameters; the authors' code has no activation after the last layer).
- ``resnet18``: ResNet-18 (7x7 stem, BasicBlocks [2, 2, 2, 2]) with every BatchNorm replaced by
  GroupNorm(2 groups), because BatchNorm mixes samples and so has no per-sample gradient
  (11,181,642 parameters for 10 classes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MODEL_NAMES = ("cnn", "resnet18")
GROUPNORM_GROUPS = 2


class PaperCNN(nn.Module):
    """The MNIST/FMNIST CNN of [003] Table 1 (28x28 inputs)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPNORM_GROUPS, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = _group_norm(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                _group_norm(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 for 10 classes with GroupNorm, as the authors ran it on CIFAR-10."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
            _group_norm(64),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        widths, blocks, layers = (64, 128, 256, 512), 2, []
        in_channels = 64
        for stage, width in enumerate(widths):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, width, stride))
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


_BUILDERS: dict[str, Callable[[int, int], nn.Module]] = {
    "cnn": lambda classes, channels: PaperCNN(classes, channels),
    "resnet18": lambda classes, channels: ResNet18GN(classes, channels),
}


def build_model(name: str, num_classes: int = 10, in_channels: int | None = None,
                seed: int | None = None) -> nn.Module:
    """A fresh model; ``seed`` makes the initial weights (theta_init) reproducible."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    channels = in_channels if in_channels is not None else (1 if name == "cnn" else 3)
    if seed is None:
        return _BUILDERS[name](num_classes, channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](num_classes, channels)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters p (the dimension of a model update)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
