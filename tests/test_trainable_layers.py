"""Training only some layers (run config ``trainable``): DP-SGD clips over and noises the
trainable parameters only, frozen ones come back with an update of exactly 0, and the server's
Robust-HDP estimate reads the trained coordinates.

The reference is computed independently of both engines: per-sample gradients by hand for the
MLP's head, and through ``torch.func`` (vmap of grad) for the partly frozen layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpcfl_flwr.aggregation.facts import RuleSettings
from dpcfl_flwr.aggregation.robust_hdp import estimate_noise_variances
from dpcfl_flwr.dpsgd.per_sample import make_engine
from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp
from dpcfl_flwr.models import ModelSpec, build
from dpcfl_flwr.models.trainable import freeze_except
from tests.poisoned_models import GhostNet, GroupNormNet, LayerNormNet

MODES = ["layerwise", "hooks", "functorch"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _frozen_base_mlp() -> nn.Module:
    return build(ModelSpec("mlp", 3, (6,), (("hidden", "8"),), trainable=("classifier",)),
                 seed=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_base_round_updates_only_the_head_by_one_dp_sgd_step(mode):
    """Full batch, one step: the head's update is -lr (sum_i clip(g_i) + N(0, (z c)^2)) / N
    with g_i = [(p_i - e_{y_i}) h_i^T, p_i - e_{y_i}] by hand, the noise drawn as the silo
    draws it from the same seed; the frozen base's update is exactly 0."""
    model = _frozen_base_mlp()
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(24, 6, generator=generator), torch.randint(0, 3, (24,),
                                                                   generator=generator)
    z, clip, lr, seed = 0.8, 0.5, 0.1, 11
    head = model.classifier
    with torch.no_grad():
        features = model.hidden(x)  # frozen: the same before and after the round
        residual = torch.softmax(head(features), 1) - F.one_hot(y, 3).float()
    per_weight = residual[:, :, None] * features[:, None, :]
    norms = (per_weight.flatten(1).pow(2).sum(1) + residual.pow(2).sum(1)).sqrt()
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    noise = torch.Generator().manual_seed(seed + 1)  # the round's noise seed (seed + 1)
    # one draw for all trained parameters, in their order
    drawn = torch.normal(0.0, z * clip, size=(head.weight.numel() + head.bias.numel(),),
                         generator=noise)
    noise_w = drawn[:head.weight.numel()].view_as(head.weight)
    noise_b = drawn[head.weight.numel():]
    expected_w = -lr * ((factors[:, None, None] * per_weight).sum(0) + noise_w) / 24
    expected_b = -lr * ((factors[:, None] * residual).sum(0) + noise_b) / 24

    config = DPSGDConfig(z, clip, lr, "full", grad_sample_mode=mode)
    update = train_dp(model, x, y, config, seed=seed).update
    torch.testing.assert_close(update["classifier.weight"], expected_w, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(update["classifier.bias"], expected_b, rtol=1e-4, atol=1e-6)
    for name in ("hidden.0.weight", "hidden.0.bias"):
        assert torch.equal(update[name], torch.zeros_like(update[name]))
    assert (factors < 1).any()  # the clip was active


def _reference_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float
                           ) -> list[torch.Tensor]:
    """sum_i clip(g_i) over the trainable parameters, per-sample gradients from torch.func."""
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}

    def loss(params, xi, yi):
        logits = functional_call(model, {**params, **fixed}, (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0), reduction="sum")

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(trained, x, y)
    flat = [grads[n].reshape(x.shape[0], -1).double() for n in trained]
    norms = torch.cat(flat, 1).norm(dim=1)
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return [(factors @ g).view_as(trained[n]).float() for n, g in zip(trained, flat,
                                                                          strict=True)]


CASES = {
    # a trained weight beside a frozen bias: the factored Linear norm leaves the bias out
    "linear weight only": (lambda: build(ModelSpec("cnn", 10, (1, 28, 28))),
                           ("classifier.weight",), (6, 1, 28, 28)),
    # one convolution (materialised per-sample gradients), the rest frozen
    "second conv": (lambda: build(ModelSpec("cnn", 10, (1, 28, 28))), ("features.3",),
                    (6, 1, 28, 28)),
    # the ghost-norm convolution with its bias frozen, then with its weight frozen
    "ghost weight": (GhostNet, ("conv2.weight",), (6, 1, 6, 6)),
    "conv bias only": (GhostNet, ("conv2.bias", "fc"), (6, 1, 6, 6)),
    "groupnorm scale": (GroupNormNet, ("norm.weight", "fc.bias"), (6, 1, 6, 6)),
    "layernorm shift": (LayerNormNet, ("norm.bias", "conv2"), (6, 1, 6, 6)),
    "mlp": (lambda: build(ModelSpec("mlp", 10, (20,), (("hidden", "16,16"),))),
            ("hidden.2.bias", "classifier"), (6, 20)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_engines_clip_over_the_trainable_parameters_only(case, mode):
    make, prefixes, shape = CASES[case]
    torch.manual_seed(3)
    model = make()
    freeze_except(model, prefixes, case)
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(shape, generator=generator), torch.randint(0, 10, (shape[0],),
                                                                  generator=generator)
    clip = 0.05  # below every record's norm here: each record's clip factor matters
    engine = make_engine(model, mode)
    try:
        sums = engine.clipped_sum(x, y, clip)
    finally:
        engine.close()
    reference = _reference_clipped_sum(model, x, y, clip)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(sums) == len(trained) == len(reference)
    for mine, expected, p in zip(sums, reference, trained, strict=True):
        assert mine.shape == p.shape
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6)
    assert sum(float(s.double().pow(2).sum()) for s in sums) ** 0.5 <= shape[0] * clip + 1e-5


def test_robust_hdp_reads_the_trained_coordinates():
    """A frozen base's coordinates, 0 in every update and ahead of the head's, do not fill
    RPCA's p' rows: the estimate is the one on the trained coordinates alone."""
    rng = np.random.default_rng(0)
    head = rng.normal(size=(6, 300)) * np.array([1, 1, 1, 2, 2, 3])[:, None]
    updates = np.concatenate([np.zeros((6, 5_000)), head], axis=1)
    settings = RuleSettings(rpca_rows=200)
    variances = estimate_noise_variances(updates, settings)
    np.testing.assert_allclose(variances, estimate_noise_variances(head, settings))
    assert np.all(variances > 0)
    assert np.argmax(variances) == 5  # the noisiest silo is seen as the noisiest
