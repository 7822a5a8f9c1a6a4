"""Weights chosen to overflow on one record (the NaN canary) cannot break DP: on every path
that sums over records, the target contributes a bounded value and nothing else.

The construction (tests/poisoned_models.py) makes the target's loss and gradient NaN or inf and
leaves every other record ordinary. Each test checks first that the construction works (the
target's loss is not finite), then that the released sums are finite and equal, with the target
in the batch, to the sums without it: its non-finite gradient counts as zero, its loss as the
loss bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dpcfl_flwr.dpsgd.per_sample as per_sample
from dpcfl_flwr.dpsgd.per_sample import make_engine
from dpcfl_flwr.dpsgd.training import (
    DPSGDConfig,
    _clipped_sum,
    bounded_losses,
    evaluation_sums,
    train_dp,
    train_sgd,
)
from dpcfl_flwr.models import ModelSpec, build, build_model
from dpcfl_flwr.privacy.metrics import LOSS_BOUND
from tests.poisoned_models import (
    EmbeddingNet,
    GhostNet,
    GroupNormNet,
    LayerNormNet,
    per_record_losses,
    plant_canary,
    without,
)

MODELS = {
    # the paper's CNN: materialised convolutions, then the factored Linear
    "cnn": (lambda: build_model("cnn", seed=1), (12, 1, 28, 28)),
    # a convolution on the ghost-norm path
    "ghost": (GhostNet, (12, 1, 6, 6)),
    # GroupNorm's materialised per-sample gradients
    "groupnorm": (GroupNormNet, (12, 1, 6, 6)),
    # the table's MLP: Linear layers only (the factored per-sample norm throughout)
    "mlp": (lambda: build(ModelSpec("mlp", 10, (20,), (("hidden", "16,16"),))), (12, 20)),
    # LayerNorm's materialised per-sample gradients (a 2-D normalized_shape)
    "layernorm": (LayerNormNet, (12, 1, 6, 6)),
    # Embedding's grouped rows (with a padding row); records are indices
    "embedding": (EmbeddingNet, (12, 5)),
}


def _records(model: nn.Module, shape: tuple[int, ...], generator: torch.Generator
             ) -> torch.Tensor:
    """Gaussian features, or indices into the table of a model that embeds its records."""
    if isinstance(model, EmbeddingNet):
        return torch.randint(0, model.vocabulary, shape, generator=generator)
    return torch.randn(shape, generator=generator)


def _poisoned(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    build, shape = MODELS[name]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build()
    x = _records(model, shape, generator)
    y = torch.randint(0, 10, (shape[0],), generator=generator)
    target = plant_canary(model, x)
    losses = per_record_losses(model, x, y)
    assert not torch.isfinite(losses[target])  # the canary fires on the target...
    assert torch.isfinite(without(losses, target)).all()  # ...and on no other record
    return model, x, y, target


def _assert_same(with_target: list[torch.Tensor], without_target: list[torch.Tensor]) -> None:
    for a, b in zip(with_target, without_target, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["layerwise", "hooks", "functorch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_target_adds_nothing_to_a_clipped_sum(name, mode):
    model, x, y, target = _poisoned(name)
    engine = make_engine(model, mode)
    try:
        with_target = engine.clipped_sum(x, y, 1.0)
        without_target = engine.clipped_sum(without(x, target), without(y, target), 1.0)
    finally:
        engine.close()
    _assert_same(with_target, without_target)


def test_the_ghost_norm_path_materialises_a_record_whose_positions_cancel():
    """Weights can make a record's per-position gradients cancel: its Gram-matrix norm and the
    weight-gradient convolution then round differently, and a record 'clipped' by the former
    had a contribution of norm 1.7e6 at clip 1 (measured without the guard)."""
    conv = nn.Conv2d(8, 64, 3, stride=3)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1, 8, 3, 3, generator=generator).repeat(1, 1, 2, 2)  # 4 equal patches
    g = torch.randn(1, 64, 1, 1, generator=generator) * 1e12
    g = torch.cat([g, -g * (1 + 1e-7), g * (1 + 1e-7), -g], 3).reshape(1, 64, 2, 2)
    piece = per_sample._conv2d_ghost(conv, (0, 0), a, g)
    factors = per_sample._clip_factors(piece.squared_norms, 1.0)
    contribution = math.sqrt(sum(float(t.double().pow(2).sum())
                                 for _, t in piece.weighted_sums(factors)))
    assert 0.5 < contribution <= 1.0 + 1e-4


def test_ordinary_records_keep_the_ghost_norm_and_its_sum():
    """The guard changes nothing for records without cancellation: the ghost path's sums
    equal the materialised path's."""
    conv = nn.Conv2d(8, 64, 3, stride=3)
    generator = torch.Generator().manual_seed(1)
    a, g = torch.randn(6, 8, 6, 6, generator=generator), torch.randn(6, 64, 2, 2,
                                                                     generator=generator)
    ghost = per_sample._conv2d_ghost(conv, (0, 0), a, g)
    exact = per_sample._conv2d_materialised(conv, (0, 0), a, g)
    torch.testing.assert_close(ghost.squared_norms, exact.squared_norms, rtol=1e-4, atol=0)
    factors = per_sample._clip_factors(exact.squared_norms, 5.0)
    for (p, mine), (q, reference) in zip(ghost.weighted_sums(factors),
                                         exact.weighted_sums(factors), strict=True):
        assert p is q
        torch.testing.assert_close(mine, reference.view_as(mine), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", ["full", 4])
def test_a_dp_sgd_round_stays_finite_and_ignores_the_target(batch):
    """Full batch (one step, the same noise draw): with the target the update is the one
    without it, divided by N instead of N - 1, i.e. the target added exactly zero. Poisson:
    finite whichever records are drawn. MR-MTL's proximal term, anchored at the poisoned
    weights, is in every step."""
    model, x, y, target = _poisoned("cnn")
    config = DPSGDConfig(1.0, 1.0, 0.1, batch, epochs=3 if batch != "full" else 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    updates = []
    for data, labels in ((x, y), (without(x, target), without(y, target))):
        model.load_state_dict(state)
        result = train_dp(model, data, labels, config, seed=3, prox=(0.5, state))
        assert all(torch.isfinite(u).all() for u in result.update.values())
        updates.append(result.update)
    if batch == "full":
        n = x.shape[0]
        for key, update in updates[0].items():
            torch.testing.assert_close(update * n, updates[1][key] * (n - 1), rtol=1e-4,
                                       atol=1e-6)


def test_a_chunked_sum_with_the_target_is_the_sum_without_it():
    """A round's logical batch is summed in physical chunks (here 5 records of 12): the chunk
    holding the target adds exactly what it would without it."""
    model, x, y, target = _poisoned("cnn")
    params = [p for p in model.parameters() if p.requires_grad]
    engine = make_engine(model, "auto")
    try:
        chunked = _clipped_sum(engine, params, x, y, 1.0, 5)
        reference = _clipped_sum(engine, params, without(x, target), without(y, target),
                                 1.0, 5)
    finally:
        engine.close()
    _assert_same(chunked, reference)


def test_plain_sgd_drops_the_target_and_keeps_every_other_record():
    """d-privacy's local SGD: one batch holding the target gives the step of the other records'
    gradients (over the whole batch's size), finite."""
    model, x, y, target = _poisoned("cnn")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    update = train_sgd(model, x, y, learning_rate=0.1, batch_size=x.shape[0], seed=0)
    assert all(torch.isfinite(u).all() for u in update.values())
    model.load_state_dict(state)
    rest = train_sgd(model, without(x, target), without(y, target), learning_rate=0.1,
                     batch_size=x.shape[0], seed=0)
    n = x.shape[0]
    for key in update:
        torch.testing.assert_close(update[key], rest[key] * (n - 1) / n, rtol=1e-4, atol=1e-6)


def test_plain_sgd_on_finite_records_is_ordinary_sgd():
    """The fast path (one backward pass) is torch's own mean cross-entropy SGD step."""
    torch.manual_seed(0)
    model = build_model("cnn", seed=2)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    reference = build_model("cnn", seed=2)
    optimiser = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(x), y).backward()
    optimiser.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_sgd(model, x, y, learning_rate=0.1, batch_size=10, seed=0)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[key])
        assert not torch.equal(value, before[key]) or key.endswith("bias")


def test_evaluation_counts_the_target_at_the_loss_bound():
    model, x, y, target = _poisoned("cnn")
    loss_with, correct_with = evaluation_sums(model, x, y, LOSS_BOUND)
    loss_without, correct_without = evaluation_sums(model, without(x, target),
                                                    without(y, target), LOSS_BOUND)
    assert math.isfinite(loss_with)
    assert loss_with - loss_without == pytest.approx(LOSS_BOUND, abs=1e-3)
    assert correct_with - correct_without in (0, 1)


def test_bounded_losses_map_every_non_finite_value_to_the_bound():
    raw = torch.tensor([0.5, math.nan, math.inf, -math.inf, 30.0, -1e-7])
    assert bounded_losses(raw, 10.0).tolist() == pytest.approx([0.5, 10, 10, 10, 10, 0])
