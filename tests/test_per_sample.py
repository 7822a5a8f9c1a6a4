"""The fast layerwise engine against Opacus: the same clipped sums, for both paper models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcfl_flwr.dpsgd.per_sample import (
    LayerwiseEngine,
    OpacusEngine,
    layerwise_supported,
    make_engine,
)
from dpcfl_flwr.models import build_model


@pytest.mark.parametrize(("name", "shape", "clip"), [
    ("cnn", (9, 1, 28, 28), 0.05), ("cnn", (9, 1, 28, 28), 1e6), ("resnet18", (3, 3, 32, 32), 0.5),
])
def test_layerwise_clipped_sums_equal_opacus(name, shape, clip):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 10, (shape[0],), generator=g)
    model = build_model(name, seed=1)
    opacus = OpacusEngine(model)
    reference = opacus.clipped_sum(x, y, clip)
    opacus.close()
    fast = LayerwiseEngine(model)
    ours = fast.clipped_sum(x, y, clip)
    fast.close()
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-6)
    # The model is left as it was: trainable, no hooks, no stray gradients.
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


def test_auto_mode_falls_back_to_opacus_for_other_layers():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.LayerNorm(3))
    assert not layerwise_supported(model)
    assert isinstance(make_engine(model, "auto"), OpacusEngine)
    assert isinstance(make_engine(build_model("cnn"), "auto"), LayerwiseEngine)
    with pytest.raises(ValueError, match="Conv2d/Linear/GroupNorm"):
        LayerwiseEngine(model)
