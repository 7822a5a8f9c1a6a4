"""``grad_sample_mode = "auto"``: layerwise by rule, else a measured, cached choice between
Opacus' hooks and functorch; never Opacus' ghost clipping, whose two backward passes let a
record contribute more than the clip under weights the server chooses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcfl_flwr.dpsgd.engine_choice import MEASURED, cache_path, choose, signature
from dpcfl_flwr.dpsgd.per_sample import LayerwiseEngine, OpacusEngine
from dpcfl_flwr.dpsgd.training import DPSGDConfig, DPSGDStepper, train_dp
from dpcfl_flwr.models import build_model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCFL_ENGINE_CACHE", str(tmp_path / "cache" / "engines.json"))


def _conv1d_net() -> nn.Module:
    """A Conv1d (no layerwise rule) then a Linear: records (B, 2, 12)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(40, 3))


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 12, generator=generator), torch.randint(0, 3, (n,),
                                                                     generator=generator)


def test_layerwise_models_are_chosen_by_rule_without_measuring():
    choice = choose(build_model("cnn", seed=0), torch.empty(0), torch.empty(0), 1.0)
    assert choice.mode == "layerwise" and "rule" in choice.reason
    assert not cache_path().exists()


def test_other_models_are_measured_once_then_read_from_the_cache():
    model, (x, y) = _conv1d_net(), _batch()
    first = choose(model, x, y, 1.0)
    assert first.mode in MEASURED and "measured per chunk of 8" in first.reason
    assert cache_path().exists()
    again = choose(model, x, y, 1.0)
    assert again.mode == first.mode and "earlier" in again.reason
    # another chunk size or architecture is another key: measured afresh
    assert signature(model, x[:4]) != signature(model, x)
    assert signature(nn.Sequential(nn.Conv1d(2, 5, 3), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(50, 3)), x) != signature(model, x)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"k": 3}'])
def test_a_corrupt_cache_is_ignored_and_rewritten(content):
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    model, (x, y) = _conv1d_net(), _batch()
    assert choose(model, x, y, 1.0).mode in MEASURED
    assert "earlier" in choose(model, x, y, 1.0).reason  # the rewritten cache answers


def test_a_cached_mode_that_is_no_candidate_is_measured_again():
    model, (x, y) = _conv1d_net(), _batch()
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(f'{{"{signature(model, x)}": "ghost"}}')
    assert "measured per chunk" in choose(model, x, y, 1.0).reason


def test_dp_sgd_on_a_model_without_a_layerwise_rule_says_what_it_measured():
    model, (x, y) = _conv1d_net(), _batch(40)
    result = train_dp(model, x, y, DPSGDConfig(1.0, 1.0, 0.1, 8), seed=0)
    assert result.engine is not None and result.engine.mode in MEASURED
    assert "measured" in result.engine.reason
    assert all(torch.isfinite(u).all() for u in result.update.values())


def test_the_stepper_sizes_chunks_from_the_layerwise_engine_s_own_memory():
    """ResNet-18-GN's 11.2M parameters would allow chunks of 12 records if every per-sample
    gradient were materialised; the layerwise engine holds ~0.7M floats per record and the
    activations ~0.5M more, so the full-batch round runs in chunks of 28 records (~0.13 GB
    each) while a Poisson batch of ~32 stays one chunk (three chunks of small kernels ran
    ~1.5x slower)."""
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    for batch, expected in ((32, 64), ("full", 28)):
        stepper = DPSGDStepper(build_model("resnet18", seed=0),
                               DPSGDConfig(1.0, 1.0, 0.01, batch), 32.0)
        try:
            _, chunk = stepper._setup(x, y)
            assert chunk == expected, batch
        finally:
            stepper.close()


def test_the_memory_probe_leaves_a_frozen_batchnorm_s_statistics_alone():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    for p in model[1].parameters():
        p.requires_grad_(False)
    model.train()
    engine = LayerwiseEngine(model)
    try:
        assert engine.floats_per_record(torch.randn(1, 1, 6, 6)) > 0
    finally:
        engine.close()
    assert int(model[1].num_batches_tracked) == 0 and model[1].training


# --- why ghost clipping is no candidate ------------------------------------------------------
def _cancelling_net(seed: int) -> nn.Module:
    """Linear(4, 2) -> Linear(2, 3) whose hidden units are exact opposites (so the logits are
    the second layer's bias) and whose second layer reads 1e15 x (sum of the three output
    gradients): 0 in exact arithmetic, a few float32 roundings of 1e15 in practice."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight[1] = -model[0].weight[0]
        model[0].bias[1] = -model[0].bias[0]
        model[1].weight.fill_(1e15)
        model[1].bias.normal_()
    return model


def _opacus_ghost_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                              clip: float) -> list[torch.Tensor]:
    """The clipped gradient sum Opacus' ghost clipping computes (its loss wrapper's two backward
    passes, no noise), as ``make_private(grad_sample_mode="ghost")`` sets it up."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    module = GradSampleModuleFastGradientClipping(model, loss_reduction="sum",
                                                  max_grad_norm=clip, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=clip,
        expected_batch_size=x.shape[0], loss_reduction="sum")
    criterion = DPLossFastGradientClipping(module, optimizer,
                                           nn.CrossEntropyLoss(reduction="sum"), "sum")
    criterion(module(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_opacus_ghost_clipping_lets_one_record_exceed_the_clip_and_our_candidates_do_not():
    """One record at clip 1, over a few draws of inputs and biases: ghost clipping's second
    pass (backward of c x loss) rounds differently from the first, where the hidden gradient
    cancelled; its released sum is far beyond the clip for some draws (~1e8 on an AMD EPYC,
    ~40 on an Intel Xeon: the rounding is the CPU's). Every engine ``auto`` can pick forms
    the norm and the sum from the same numbers and stays within the clip."""
    worst = {"ghost": 0.0, "layerwise": 0.0, "hooks": 0.0, "functorch": 0.0}
    for seed in range(40):
        model = _cancelling_net(seed)
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(1, 4, generator=generator), torch.randint(0, 3, (1,),
                                                                     generator=generator)
        assert torch.isfinite(F.cross_entropy(model(x), y))
        ghost = _opacus_ghost_clipped_sum(copy.deepcopy(model), x, y, 1.0)  # hooks stay on it
        worst["ghost"] = max(worst["ghost"], _norm(ghost))
        for mode in ("layerwise", "hooks", "functorch"):
            engine = LayerwiseEngine(model) if mode == "layerwise" else OpacusEngine(model, mode)
            try:
                worst[mode] = max(worst[mode], _norm(engine.clipped_sum(x, y, 1.0)))
            finally:
                engine.close()
    assert worst["ghost"] > 10.0, worst
    assert all(worst[mode] <= 1.0 + 1e-5 for mode in ("layerwise", "hooks", "functorch")), worst
    assert "ghost" not in MEASURED
