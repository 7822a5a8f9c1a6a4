"""The paper's models: exact parameter counts (docs/experiments.md#models) and
per-sample-gradient compatibility."""

from __future__ import annotations

import pytest
import torch
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from dpcfl_flwr.models import build_model, count_parameters


@pytest.mark.parametrize(("name", "expected"), [("cnn", 28_938), ("resnet18", 11_181_642)])
def test_parameter_counts_match_the_paper(name, expected):
    assert count_parameters(build_model(name)) == expected


@pytest.mark.parametrize(("name", "shape"), [("cnn", (3, 1, 28, 28)), ("resnet18", (2, 3, 32, 32))])
def test_models_are_opacus_compatible_and_give_per_sample_gradients(name, shape):
    model = build_model(name, seed=0)
    assert ModuleValidator.validate(model, strict=False) == []
    gsm = GradSampleModule(model, loss_reduction="sum")
    x, y = torch.randn(shape), torch.tensor([1, 2, 3][: shape[0]])
    torch.nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    for p in model.parameters():
        assert p.grad_sample.shape == (shape[0], *p.shape)
        torch.testing.assert_close(p.grad_sample.sum(0), p.grad, rtol=1e-4, atol=1e-5)
    gsm.cleanup()


def test_seeded_models_are_identical_and_do_not_touch_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_model("cnn", seed=5), build_model("cnn", seed=5)
    assert torch.rand(1) == before
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        assert torch.equal(va, vb)


def test_seeded_cnn_is_the_first_draw_after_seeding_in_layer_order():
    """theta_init of seed s is what a script gets by seeding torch with s and building the
    paper's CNN first (conv 1, conv 2, linear, each weight then bias), as the authors' script
    does; reordering the layers here would silently change every run's initial model."""
    torch.manual_seed(7)
    layers = [torch.nn.Conv2d(1, 16, 5, padding=2), torch.nn.Conv2d(16, 32, 5, padding=2),
              torch.nn.Linear(32 * 7 * 7, 10)]
    expected = [t for layer in layers for t in (layer.weight, layer.bias)]
    ours = list(build_model("cnn", seed=7).parameters())
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected, strict=True):
        assert torch.equal(a, b)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg")
