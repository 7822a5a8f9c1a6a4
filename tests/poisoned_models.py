"""Weights a malicious server crafts so that the forward pass overflows on one record only: the
NaN canary (docs/threat-model.md#the-server-chooses-the-weights).

The first layer's unit 0 (a convolution's filter, or for a table's MLP a Linear unit) becomes
a detector that fires only on the target record (its response is above a threshold set between
the target's and every other record's);
every later layer's unit 0 reads only unit 0 of the layer before, times 1e30. On the target the
logits overflow to inf, so its loss and gradient are inf or NaN; on every other record unit 0 is
exactly 0 all the way, so their losses and gradients stay ordinary. Without per-record guards
one such record turns a whole clipped sum, and so the released update, into NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

AMPLIFY = 1e30


class GhostNet(nn.Module):
    """A small network whose second convolution takes the layerwise engine's ghost-norm path
    (4 output positions, fan-in 36, 64 filters); inputs are (B, 1, 6, 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 64, 3, stride=3)
        self.fc = nn.Linear(64 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(torch.flatten(hidden, 1))


class GroupNormNet(nn.Module):
    """Convolutions with a GroupNorm (one group per channel) between them; (B, 1, 6, 6). The
    norm comes before the amplification: GroupNorm would scale an overflow back down."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(4, 4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.conv2(self.norm(F.relu(self.conv1(x)))))
        return self.fc(torch.flatten(hidden, 1))


class LayerNormNet(nn.Module):
    """:class:`GroupNormNet` with a LayerNorm over each channel's 6 x 6 positions (a 2-D
    ``normalized_shape``), which normalises every channel on its own as GroupNorm(4, 4) does:
    unit 0 stays exactly 0 on every record but the target; (B, 1, 6, 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm((6, 6))
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.conv2(self.norm(F.relu(self.conv1(x)))))
        return self.fc(torch.flatten(hidden, 1))


class EmbeddingNet(nn.Module):
    """Records of 5 indices into a table of 16 rows of 4 (row 0 the padding row), embedded and
    flattened, then an MLP with two hidden layers: the canary's detector reads the embedded
    record, and two amplifying layers overflow it to inf; (B, 5) integers below 16."""

    vocabulary = 16

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocabulary, 4, padding_idx=0)
        self.hidden = nn.Sequential(nn.Linear(5 * 4, 16), nn.ReLU(), nn.Linear(16, 16),
                                    nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.hidden(torch.flatten(self.embed(x), 1)))


def _trainable_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]


@torch.no_grad()
def plant_canary(model: nn.Module, x: torch.Tensor, fire: bool = True) -> int:
    """Make ``model`` (in place) overflow on one record of ``x`` only; returns its index.

    The target is the record whose response to the first layer's unit 0 is highest
    (unique for real images); the threshold sits halfway to the second highest. ``fire=False``
    sets it above every record instead: the same weights, on data without the target. A
    model that starts with an Embedding has its detector read the embedded records."""
    first, *later = _trainable_layers(model)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        x = embedding(x)
    if isinstance(first, nn.Conv2d):
        responses = F.conv2d(x, first.weight[:1], None, first.stride, first.padding)
        channels = first.out_channels
    else:  # a Linear first layer (the MLP): one response per record
        responses = F.linear(torch.flatten(x, 1), first.weight[:1])
        channels = first.out_features
    peaks = responses.flatten(1).amax(1)
    top = torch.topk(peaks, 2)
    target = int(top.indices[0])
    first.bias[0] = -float(top.values.mean() if fire else top.values[0] + 1.0)
    for layer in later:
        if layer.bias is not None:
            layer.bias[0] = 0.0
        layer.weight[0] = 0.0
        if isinstance(layer, nn.Conv2d):  # every tap: unit 0 fires wherever it is
            layer.weight[0, 0] = AMPLIFY
            channels = layer.out_channels
        else:  # after a flatten of (channels, positions): unit 0's features come first
            layer.weight[0, :layer.in_features // channels] = AMPLIFY
    return target


def per_record_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none")


def without(x: torch.Tensor, index: int) -> torch.Tensor:
    return torch.cat([x[:index], x[index + 1:]])
