"""The fast layerwise engine against Opacus (the same clipped sums, for both paper models) and
against single-record backward passes (LayerNorm, Embedding, GroupNorm and both conv paths,
in float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcfl_flwr.dpsgd.per_sample import (
    LayerwiseEngine,
    OpacusEngine,
    engine_name,
    layerwise_supported,
    make_engine,
)
from dpcfl_flwr.models import ModelSpec, build, build_model


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
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(4, 3))
    assert not layerwise_supported(model)
    assert isinstance(make_engine(model, "auto"), OpacusEngine)
    assert isinstance(make_engine(build_model("cnn"), "auto"), LayerwiseEngine)
    with pytest.raises(ValueError, match="Conv2d .*, Linear, GroupNorm, LayerNorm or Embedding"):
        LayerwiseEngine(model)


# --- LayerNorm and Embedding against an independent per-sample computation -------------------
class _TableNet(nn.Module):
    """Linear -> LayerNorm -> ReLU -> Linear: a table's MLP with a normalised hidden layer."""

    def __init__(self, **norm: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, **norm), nn.ReLU(),
                                  nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _GridNet(nn.Module):
    """A Linear on the last axis of (B, 3, 4, 5) records, a LayerNorm over each record's 4 x 5
    slices (a 2-D normalized_shape, 3 positions per record), then a Linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(5, 5)
        self.norm = nn.LayerNorm((4, 5))
        self.classifier = nn.Linear(3 * 4 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(torch.tanh(self.norm(self.mix(x))), 1))


class _BagNet(nn.Module):
    """Embedding(11, 4) -> mean over each record's positions -> (LayerNorm) -> Linear."""

    def __init__(self, padding_idx: int | None, norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(4) if norm else nn.Identity()
        self.classifier = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(self.embed(x).flatten(1, -2).mean(1)))


class _ConvNet(nn.Module):
    """Conv (materialised: 16 positions, fan-in 9) -> GroupNorm -> strided, dilated conv with
    bias on the ghost-norm path (4 positions, fan-in 36, 16 filters) -> Linear; (B, 1, 4, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.ghost = nn.Conv2d(4, 16, 3, stride=2, padding=2, dilation=2)
        self.classifier = nn.Linear(16 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.ghost(torch.tanh(self.norm(self.conv(x)))))
        return self.classifier(torch.flatten(hidden, 1))


def _indices(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Indices from a few rows only (0..4 of 11), so records repeat rows and use row 0, the
    padding row of the padded nets."""
    return torch.randint(0, 5, shape, generator=generator)


NETS = {
    "linear-layernorm-relu-linear": (lambda: _TableNet(), lambda g: torch.randn(7, 6, generator=g)),
    "layernorm without bias": (lambda: _TableNet(bias=False),
                               lambda g: torch.randn(7, 6, generator=g)),
    "layernorm without affine": (lambda: _TableNet(elementwise_affine=False),
                                 lambda g: torch.randn(7, 6, generator=g)),
    "layernorm over 4 x 5": (_GridNet, lambda g: torch.randn(7, 3, 4, 5, generator=g)),
    "embedding mean linear": (lambda: _BagNet(None), lambda g: _indices((7, 9), g)),
    "embedding with padding": (lambda: _BagNet(0), lambda g: _indices((7, 9), g)),
    "embedding of 2-D records": (lambda: _BagNet(3), lambda g: _indices((7, 3, 4), g)),
    "embedding layernorm": (lambda: _BagNet(0, norm=True), lambda g: _indices((7, 9), g)),
    "conv groupnorm ghost-conv linear": (_ConvNet, lambda g: torch.randn(7, 1, 4, 4, generator=g)),
    # layer chains: the backward pass by hand (dpsgd/layer_chain.py), not autograd
    "chain: the registry's mlp": (
        lambda: build(ModelSpec("mlp", 3, (2, 3), (("hidden", "8,8"),))),
        lambda g: torch.randn(7, 2, 3, generator=g)),
    "chain: logistic regression": (
        lambda: build(ModelSpec("mlp", 3, (6,), (("hidden", ""),))),
        lambda g: torch.randn(7, 6, generator=g)),
    "chain: nested sequential, no bias": (
        lambda: nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(6, 5, bias=False),
                                                          nn.ReLU(inplace=True)),
                              nn.Linear(5, 3)),
        lambda g: torch.randn(7, 3, 2, generator=g)),
}


def _per_sample_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor
                          ) -> list[torch.Tensor]:
    """Each record's gradient of the trainable parameters from its own backward pass, (B, P)
    per parameter: autograd on one record, independent of every engine."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        rows.append([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
    return [torch.stack(column) for column in zip(*rows, strict=True)]


def _float64_case(name: str, frozen: tuple[str, ...] = ()) -> tuple[nn.Module, torch.Tensor,
                                                                       torch.Tensor]:
    make, inputs = NETS[name]
    torch.manual_seed(2)
    model = make().double()
    for key, p in model.named_parameters():
        p.requires_grad_(not key.startswith(frozen) if frozen else True)
    generator = torch.Generator().manual_seed(3)
    x = inputs(generator)
    x = x.double() if x.is_floating_point() else x
    return model, x, torch.randint(0, 3, (x.shape[0],), generator=generator)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("frozen", [(), ("embed", "norm.bias", "body.1.bias",
                                        "hidden.2.weight")])
@pytest.mark.parametrize("name", list(NETS))
def test_layerwise_per_sample_norms_and_clipped_sums_equal_single_record_backward(name, frozen):
    """float64, so the rule itself is checked (to 1e-10), not float32 rounding: every record's
    squared norm, and the clipped sum at a clip below some records' norms and above others'.
    Frozen: the table or the LayerNorm's shift takes no part in the norm or the sum."""
    model, x, y = _float64_case(name, frozen)
    assert layerwise_supported(model) and engine_name(model, "auto") == "layerwise"
    per_record = _per_sample_reference(model, x, y)
    squared = torch.stack([g.pow(2).sum(1) for g in per_record]).sum(0)
    engine = make_engine(model, "auto")
    assert isinstance(engine, LayerwiseEngine)
    assert (engine.chain is not None) == name.startswith("chain")
    try:
        ours = torch.stack([piece.squared_norms for piece in engine._layer_grads(x, y)]).sum(0)
        torch.testing.assert_close(ours, squared, rtol=1e-10, atol=1e-12)
        clip = float(squared.sqrt().median())
        sums = engine.clipped_sum(x, y, clip)
    finally:
        engine.close()
    factors = (clip / (squared.sqrt() + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any() and (factors == 1).any()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(sums) == len(trained)
    for mine, g, p in zip(sums, per_record, trained, strict=True):
        torch.testing.assert_close(mine, (factors @ g).view_as(p), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_an_embedding_record_s_gradient_is_its_rows_only(padding_idx):
    """A record that repeats a row adds its output gradients into that row; the padding row
    gets nothing; rows no record used stay 0 in the clipped sum."""
    model, x, y = _float64_case("embedding mean linear")
    model.embed.padding_idx = padding_idx
    x = torch.tensor([[1, 1, 1, 0, 2, 0, 0, 1, 2]] * 2 + [[4] * 9] * 5)
    engine = LayerwiseEngine(model)
    try:
        table = engine.clipped_sum(x, y[:7], math.inf)[0]
    finally:
        engine.close()
    used = {0, 1, 2, 4} - {padding_idx}
    assert [bool(table[v].abs().sum() > 0) for v in range(11)] == [v in used for v in range(11)]
    reference = _per_sample_reference(model, x, y[:7])[0].sum(0).view_as(table)
    torch.testing.assert_close(table, reference, rtol=1e-10, atol=1e-12)


def test_layerwise_layernorm_and_embedding_equal_opacus_in_float32():
    """In the dtype training uses, against Opacus' own LayerNorm and Embedding rules (no
    padding row: Opacus 1.6 gives the padding row a per-sample gradient, autograd does not)."""
    for name in ("linear-layernorm-relu-linear", "layernorm over 4 x 5", "embedding mean linear"):
        make, inputs = NETS[name]
        torch.manual_seed(0)
        model = make()
        x = inputs(torch.Generator().manual_seed(1))
        y = torch.randint(0, 3, (x.shape[0],), generator=torch.Generator().manual_seed(2))
        sums = []
        for engine in (OpacusEngine(model), LayerwiseEngine(model)):
            sums.append(engine.clipped_sum(x, y, 0.1))
            engine.close()
        for ours, reference in zip(sums[1], sums[0], strict=True):
            torch.testing.assert_close(ours, reference, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("table", [
    nn.Embedding(11, 4, sparse=True), nn.Embedding(11, 4, max_norm=1.0),
    nn.Embedding(11, 4, scale_grad_by_freq=True),
])
def test_embeddings_the_layerwise_rule_does_not_cover_fall_back_to_opacus(table):
    """A sparse gradient, a forward pass that renormalises the table, and a gradient scaled by
    the batch's word counts (no per-record gradient) are left to Opacus."""
    model = nn.Sequential(table, nn.Flatten(), nn.Linear(8, 3))
    assert not layerwise_supported(model)
    assert engine_name(model, "auto") == "Opacus (hooks)"
    with pytest.raises(ValueError, match="Embedding"):
        LayerwiseEngine(model)
    table.weight.requires_grad_(False)  # a frozen table needs no rule
    assert engine_name(model, "auto") == "layerwise"


def test_groupnorm_on_records_without_positions():
    """GroupNorm on (B, C) features: the per-sample gradient is the record's own (torch's
    sum over no dimensions would sum the batch away)."""
    model = nn.Sequential(nn.Linear(5, 4), nn.GroupNorm(2, 4), nn.Linear(4, 3)).double()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 5, generator=generator).double(), torch.randint(0, 3, (6,))
    squared = torch.stack([g.pow(2).sum(1) for g in _per_sample_reference(model, x, y)]).sum(0)
    engine = LayerwiseEngine(model)
    try:
        ours = torch.stack([piece.squared_norms for piece in engine._layer_grads(x, y)]).sum(0)
    finally:
        engine.close()
    torch.testing.assert_close(ours, squared, rtol=1e-10, atol=1e-12)


class _UndeclaredTanh(nn.Module):
    """A model whose declared layer chain leaves out the tanh of its forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.first(x)))

    def layer_chain(self) -> list[nn.Module]:
        return [self.first, nn.ReLU(), self.last]


def test_a_layer_chain_that_is_not_the_forward_pass_is_refused():
    """Its gradients would be another model's: the engine checks the chain's logits against
    the model's once, on the first records, and refuses."""
    engine = LayerwiseEngine(_UndeclaredTanh())
    assert engine.chain is not None
    with pytest.raises(ValueError, match="does not compute the model's forward pass"):
        engine.clipped_sum(torch.randn(6, 4), torch.randint(0, 3, (6,)), 1.0)


def test_chains_the_engine_does_not_follow_go_through_autograd():
    """A Flatten of other dims, a layer without a backward rule, or no Linear layer at all:
    no chain, so autograd's path, with the same sums."""
    for model in (nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)),
                  nn.Sequential(nn.Flatten(0), nn.Linear(4, 3))):
        assert LayerwiseEngine(model).chain is None
    assert LayerwiseEngine(nn.Sequential(nn.Linear(4, 3))).chain is not None
