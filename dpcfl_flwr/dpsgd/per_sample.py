"""Per-sample clipped gradient sums: the expensive core of DP-SGD, in two interchangeable ways.

Both return sum_i clip(grad l_i, c) for a batch, parameter by parameter, over the trainable
parameters only (``requires_grad``): a frozen parameter (run config ``trainable``) counts in no
norm and gets no sum, so DP-SGD neither clips over it nor noises it.

- :class:`OpacusEngine` wraps the model in Opacus' ``GradSampleModule`` (hooks, or functorch):
  any layer Opacus supports, at Opacus' speed. Autograd also computes the ordinary summed
  weight gradients, which DP-SGD then throws away.
- :class:`LayerwiseEngine` handles models whose trained layers are Conv2d, Linear, GroupNorm,
  LayerNorm and Embedding (the paper's CNN and ResNet-18-GN, the tables' MLP, models with
  normalised layers or embedded categories). The backward pass asks autograd for the layers'
  output gradients only, so it computes no summed weight gradient; per-sample ones are formed
  layer by layer from the saved activations (one grouped weight-gradient convolution per
  conv), and Linear layers never materialise them (per-sample norm ||g|| ||a||, clipped sum
  one matmul), nor Embedding layers (a record's used rows only, never its V x D table).
  Tests check it against Opacus and per-record autograd to float precision; bench/ measures
  the speed-up.

The server chooses the weights (docs/threat-model.md#the-server-chooses-the-weights), so a
record's gradient may overflow: a record whose per-sample squared norm is not finite
contributes nothing and cannot turn the batch's sum into NaN (Opacus engine: clip factor 0 and
its rows zeroed before any sum; layerwise engine: removed from the batch, whose sum is computed
again without it). Every record's contribution is bounded by ``clip`` whatever the weights.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_weight

from .layer_chain import linear_chain

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Inputs never require gradients, so torch warns on every backward that Opacus' first-layer
# hook sees only output gradients: exactly what per-sample gradients need.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


class ClippedSumEngine(Protocol):
    """Computes the sum over a batch of per-sample gradients clipped to norm ``clip``."""

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, clip: float) -> list[torch.Tensor]:
        ...

    def close(self) -> None:
        ...

    def floats_per_record(self, record: torch.Tensor) -> int:
        """Floats the engine holds per record of a chunk beyond the model's own activations
        (per-sample gradients and what forms them), for one ``record`` (shape (1, ...)):
        what sizes the physical batch."""
        ...


def _clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, clip / (||g_i|| + 1e-6)) per record, and 0 for a record whose squared norm is
    not finite (inf or NaN: an overflow the server's weights can cause for one record).
    ``clip`` = inf gives factor 1 to every finite record (an unclipped sum of finite ones)."""
    # The same 1e-6 guard as Opacus, so both engines clip identically.
    factors = (clip / (squared_norms.sqrt() + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(squared_norms), factors, torch.zeros_like(factors))


def _kept_rows(tensor: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``tensor`` (records along dim 0) with the rows of records of factor 0 set to zero: a
    weight of 0 times an inf or NaN row is NaN, so a dropped record must be removed, not
    scaled. Returns ``tensor`` itself when no record is dropped (the usual case)."""
    keep = factors > 0
    if bool(keep.all()):
        return tensor
    mask = keep.view(-1, *([1] * (tensor.dim() - 1)))
    return torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype))


class OpacusEngine:
    """Per-sample gradients from Opacus' GradSampleModule, clipped and summed here."""

    def __init__(self, model: nn.Module, mode: str = "hooks") -> None:
        if mode not in ("hooks", "functorch"):
            raise ValueError(f"Opacus grad-sample modes are 'hooks' and 'functorch', not {mode!r}")
        # Imported here: Opacus costs ~1.5 s to import, paid by every ClientApp process of a
        # deployment (one per message) although the paper's models use the layerwise engine.
        from opacus import GradSampleModule

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum",
                                    force_functorch=(mode == "functorch"))

    def _reset(self) -> None:
        for p in self.params:
            setattr(p, "grad_sample", None)  # noqa: B010 - Opacus' dynamic attribute
            p.grad = None

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, clip: float) -> list[torch.Tensor]:
        self._reset()
        F.cross_entropy(self.gsm(x), y, reduction="sum").backward()
        grads = [getattr(p, "grad_sample").reshape(x.shape[0], -1)  # noqa: B009 - dynamic
                 for p in self.params]
        factors = _clip_factors(torch.stack([g.pow(2).sum(1) for g in grads]).sum(0), clip)
        sums = [(factors @ _kept_rows(g, factors)).view_as(p)
                for g, p in zip(grads, self.params, strict=True)]
        self._reset()
        return sums

    def floats_per_record(self, record: torch.Tensor) -> int:
        """Every trainable parameter's per-sample gradient is materialised."""
        return sum(p.numel() for p in self.params)

    def close(self) -> None:
        self.gsm.cleanup()


_SUPPORTED = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.LayerNorm, nn.Embedding)


def _rule_applies(module: nn.Module) -> bool:
    """Whether :func:`_per_sample` has an exact rule for ``module`` as configured: a layer of
    :data:`_SUPPORTED`, except conv padding given as a string (its amount is not known here),
    and an Embedding that is sparse (its gradient is a sparse tensor), renormalises its rows in
    the forward pass (``max_norm`` writes to the weights) or scales its gradient by the
    batch's word frequencies (``scale_grad_by_freq``: a record's gradient would depend on the
    other records, so it has no per-record gradient to clip). Those fall back to Opacus."""
    if not isinstance(module, _SUPPORTED):
        return False
    if isinstance(module, nn.Conv2d):
        return not isinstance(module.padding, str)
    if isinstance(module, nn.Embedding):
        return not (module.sparse or module.max_norm is not None or module.scale_grad_by_freq)
    return True


def layerwise_supported(model: nn.Module) -> bool:
    """True when every trainable parameter belongs to a layer :func:`_rule_applies` to."""
    owned = {id(p) for m in model.modules() if _rule_applies(m)
             for p in m.parameters(recurse=False)}
    return all(id(p) in owned for p in model.parameters() if p.requires_grad)


class LayerwiseEngine:
    """Activation-gradient backward pass + per-layer per-sample weight gradients."""

    def __init__(self, model: nn.Module) -> None:
        if not layerwise_supported(model):
            raise ValueError("the layerwise engine needs models whose trainable layers are "
                             "Conv2d (numeric padding), Linear, GroupNorm, LayerNorm or "
                             "Embedding (dense, no max_norm, no scale_grad_by_freq)")
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, _SUPPORTED)
                       and any(p.requires_grad for p in m.parameters(recurse=False))]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        # A plain Linear/ReLU chain gets its output gradients by hand (layer_chain), once its
        # chain is seen to compute the model's forward pass; other models through autograd.
        self.chain = linear_chain(model)
        self._chain_checked = False
        self._handles = [] if self.chain is not None else [
            layer.register_forward_hook(self._capture) for layer in self.layers]

    def _capture(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                 output: torch.Tensor) -> torch.Tensor:
        if not output.requires_grad:  # the first layer: make its output a graph leaf
            output = output.detach().requires_grad_(True)
        self._records.append((module, inputs[0].detach(), output))
        return output

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, clip: float) -> list[torch.Tensor]:
        """The clipped sum; a record whose squared norm is not finite is removed from the
        batch and the others' sum computed again without it (records are independent), so
        every rule below sums finite numbers only and needs no mask (one check a step)."""
        pieces = self._layer_grads(x, y)
        squared = torch.stack([piece.squared_norms for piece in pieces]).sum(0)
        finite = torch.isfinite(squared)
        if not bool(finite.all()):
            kept = finite.nonzero().squeeze(1)
            if kept.numel() == 0:
                return [torch.zeros_like(p) for p in self.params]
            return self.clipped_sum(x[kept], y[kept], clip)
        # every norm is finite here: the factor is Opacus' min(1, c / (||g_i|| + 1e-6))
        return self._collect(pieces, torch.div(clip, squared.sqrt() + 1e-6).clamp_(max=1.0))

    def _layer_grads(self, x: torch.Tensor, y: torch.Tensor) -> list[_LayerGrads]:
        """One forward and one activation-gradient backward pass of the summed cross-entropy
        of ``x`` (B records) against labels ``y`` (B,): each trained layer's per-sample
        gradients, whose squared norms (B,) add up to the records' squared gradient norms."""
        if self.chain is not None:
            if not self._chain_checked:
                self._check_chain(x)
            return [_per_sample(m, a, g) for m, a, g in self.chain.output_grads(x, y)]
        self._records = []
        loss = F.cross_entropy(self.model(x), y, reduction="sum")
        # Gradients with respect to the layers' outputs only: autograd's engine then runs
        # no (wasted) summed weight gradient, nor anything below the first trained layer.
        grads_out = torch.autograd.grad(loss, [out for _, _, out in self._records])
        if len({id(m) for m, _, _ in self._records}) != len(self._records):
            raise ValueError("the layerwise engine cannot clip layers used twice per forward")
        pieces = [_per_sample(m, a, g) for (m, a, _), g in
                  zip(self._records, grads_out, strict=True)]
        self._records = []
        return pieces

    def _check_chain(self, x: torch.Tensor) -> None:
        """Refuse a model whose declared layer chain does not compute its forward pass (a
        ``layer_chain()`` that leaves a layer out, say): its gradients would be another
        model's. Once per engine, on the first records."""
        assert self.chain is not None
        with torch.no_grad():
            ours, theirs = self.chain.forward(x)[-1], self.model(x)
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6,
                                                            equal_nan=True):
            raise ValueError(f"{type(self.model).__name__}.layer_chain() does not compute the "
                             "model's forward pass")
        self._chain_checked = True

    def floats_per_record(self, record: torch.Tensor) -> int:
        """What each trained layer's rule holds per record (:func:`_rule_floats`), from the
        layer shapes of one no-grad forward pass of ``record``: far less than the parameter
        count for models with ghost-norm convs and factored Linear layers (ResNet-18-GN at
        32 x 32: ~0.2M of 11.2M), so chunks, and the kernels' batches, stay large."""
        shapes: dict[nn.Module, tuple[torch.Size, torch.Size]] = {}

        def note(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
                 ) -> None:
            shapes[module] = (inputs[0].shape, output.shape)

        try:
            probe_forward(self.model, record, self.layers, note)
        finally:
            self._records = []
        return max(1, sum(_rule_floats(m, *shapes[m]) for m in self.layers if m in shapes))

    def _collect(self, pieces: list[_LayerGrads], factors: torch.Tensor) -> list[torch.Tensor]:
        by_param = {id(p): total for piece in pieces for p, total in piece.weighted_sums(factors)}
        return [by_param[id(p)].view_as(p) for p in self.params]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def probe_forward(model: nn.Module, record: torch.Tensor, modules: Sequence[nn.Module],
                  hook: Callable[[nn.Module, tuple[torch.Tensor, ...], Any], None]) -> None:
    """One forward pass of ``record`` without gradients and in eval mode, ``hook`` on each of
    ``modules``: a look at the layers' shapes that changes nothing. Every module's own mode is
    restored after (a frozen BatchNorm stays in eval), and a BatchNorm in training mode does
    not count this record in its statistics."""
    handles = [module.register_forward_hook(hook) for module in modules]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(record)
    finally:
        for module, mode in modes:
            module.train(mode)
        for handle in handles:
            handle.remove()


def activation_floats(model: nn.Module, record: torch.Tensor) -> int:
    """Floats of the outputs of ``model``'s innermost modules for one ``record`` (shape
    (1, ...)): a record's activations, which a chunk holds beside what an engine reports."""
    total = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        nonlocal total
        outputs = output if isinstance(output, tuple | list) else (output,)
        total += sum(o.numel() for o in outputs if isinstance(o, torch.Tensor))

    probe_forward(model, record,
                  [m for m in model.modules() if next(m.children(), None) is None], count)
    return total


def _rule_floats(module: nn.Module, inputs: torch.Size, output: torch.Size) -> int:
    """Floats :func:`_per_sample`'s rule for ``module`` holds per record, given one record's
    input and output shapes (batch first)."""
    own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
    if isinstance(module, nn.Conv2d):
        positions = output[2] * output[3]
        if _conv_uses_ghost(module, positions):  # unfolded inputs (and a copy), Gram matrices
            fan_in = module.weight[0].numel()
            return 2 * fan_in * positions + 2 * positions * positions + output[1] * positions
        return own
    if isinstance(module, nn.Linear) and len(inputs) == 2:
        return inputs[1] + output[1]  # factored: never the outer product
    if isinstance(module, nn.Embedding):
        return output.numel()  # a record's used rows
    return own + inputs.numel()  # materialised, plus the normalised input of a norm layer


class _LayerGrads:
    """Per-sample gradients of one layer's parameters, possibly in factored form."""

    def __init__(self, squared_norms: torch.Tensor,
                 weighted: Callable[[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]):
        self.squared_norms = squared_norms
        self._weighted = weighted

    def weighted_sums(self, factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._weighted(factors)


def _per_sample(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    if isinstance(module, nn.Linear):
        return _linear(module, a, g)
    if isinstance(module, nn.Conv2d):
        return _conv2d(module, a, g)
    if isinstance(module, nn.GroupNorm):
        return _group_norm(module, a, g)
    if isinstance(module, nn.LayerNorm):
        return _layer_norm(module, a, g)
    if isinstance(module, nn.Embedding):
        return _embedding(module, a, g)
    raise TypeError(f"no per-sample rule for {type(module).__name__}")


def _materialised(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _LayerGrads:
    """Per-sample gradients held as (B, ...) tensors: norms and weighted sums directly."""
    flat = [(p, t.reshape(t.shape[0], -1)) for p, t in pairs]
    squared = torch.stack([torch.linalg.vector_norm(t, dim=1) for _, t in flat]).pow(2).sum(0)
    return _LayerGrads(squared, lambda c: [(p, c @ t) for p, t in flat])


def _trained(parameter: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """Whether a layer's weight or bias is trained: frozen ones (``trainable`` prefixes) take
    no part in the per-sample norm, the clipped sum or the noise."""
    return parameter is not None and parameter.requires_grad


def _linear(module: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    weight_on, bias_on = _trained(module.weight), _trained(module.bias)
    if a.dim() != 2:  # sequence inputs: fall back to materialised outer products
        pairs = []
        if weight_on:
            pairs.append((module.weight, torch.einsum("b...o,b...i->boi", g, a)))
        if bias_on:
            pairs.append((module.bias, g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)))
        return _materialised(pairs)
    # grad_W of sample i is g_i a_i^T: ||g_i a_i^T||^2 = ||g_i||^2 ||a_i||^2.
    g_sq = torch.linalg.vecdot(g, g)
    if weight_on:
        a_sq = torch.linalg.vecdot(a, a)
        # with the bias: g_sq a_sq + g_sq, one fused call (the MLP's step is call-bound)
        squared = torch.addcmul(g_sq, g_sq, a_sq) if bias_on else g_sq * a_sq
    else:
        squared = g_sq

    def weighted(c: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        scaled = g * c.unsqueeze(1)
        out = []
        if weight_on:
            out.append((module.weight, scaled.t() @ a))
        if bias_on:
            out.append((module.bias, scaled.sum(0)))
        return out

    return _LayerGrads(squared, weighted)


#: How much more arithmetic the ghost norm may cost than materialising and still be taken: on
#: this CPU (one thread, batch 32) its batched matrix products run ~2x faster per flop than the
#: grouped weight-gradient convolution, e.g. ResNet's 64->64 3x3 conv at 8x8 (T = 64): 15.6 ms
#: ghost against 25.6 ms materialised, although the flop counts are equal.
_GHOST_FLOP_ADVANTAGE = 2


def _conv_uses_ghost(module: nn.Conv2d, positions: int) -> bool:
    """Whether a conv with ``positions`` output positions per record takes the ghost-norm path.
    Per sample, materialising the gradient costs T*d*p; its norm from Gram matrices costs
    T^2 (d + p) (T output positions, d fan-in, p filters). Deep ResNet layers have few
    positions and wide filters, so there the norm is far cheaper than the gradient."""
    fan_in = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
    return (module.groups == 1 and _trained(module.weight) and positions
            * (fan_in + module.out_channels) < _GHOST_FLOP_ADVANTAGE * fan_in * module.out_channels)


def _conv2d(module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    padding = module.padding
    if isinstance(padding, str):
        raise ValueError("the layerwise engine needs numeric conv padding")
    if _conv_uses_ghost(module, g.shape[2] * g.shape[3]):
        return _conv2d_ghost(module, padding, a, g)
    return _conv2d_materialised(module, padding, a, g)


def _conv2d_materialised(module: nn.Conv2d, padding: tuple[int, ...], a: torch.Tensor,
                         g: torch.Tensor) -> _LayerGrads:
    batch = a.shape[0]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if _trained(module.bias):
        pairs.append((module.bias, g.sum((2, 3))))
    if not _trained(module.weight):
        return _materialised(pairs)
    if module.groups == 1:
        # The batch becomes the group dimension of one weight-gradient convolution: every
        # sample's gradient comes from the backend's conv kernel, ~3x faster on this CPU than
        # unfold + bmm for the paper's CNN (bench/RESULTS.md). With one input channel the
        # native kernel beats oneDNN's grouped one (~30% on the CNN's first layer).
        with _without_onednn(module.in_channels == 1):
            weight = conv2d_weight(
                a.reshape(1, batch * a.shape[1], *a.shape[2:]),
                (batch * module.out_channels, *module.weight.shape[1:]),
                g.reshape(1, batch * g.shape[1], *g.shape[2:]),
                module.stride, padding, module.dilation, groups=batch)
    else:
        columns = F.unfold(a, module.kernel_size, module.dilation, padding, module.stride)
        groups = module.groups
        columns = columns.reshape(batch, groups, -1, columns.shape[-1])
        grads_g = g.reshape(batch, groups, -1, g.shape[2] * g.shape[3])
        weight = torch.einsum("bgol,bgil->bgoi", grads_g, columns)
    pairs.insert(0, (module.weight, weight.reshape(batch, *module.weight.shape)))
    return _materialised(pairs)


@contextlib.contextmanager
def _without_onednn(active: bool) -> Iterator[None]:
    if not active or not torch.backends.mkldnn.is_available():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes TF32 on Intel GPUs when toggling oneDNN
        with torch.backends.mkldnn.flags(enabled=False):
            yield


#: A record whose ghost norm is below this fraction of its triangle bound sum_t ||a_t|| ||g_t||
#: is cancelling across positions; the float32 Gram sum and the weight-gradient convolution then
#: round differently (errors ~1e-7 T of the bound), and weights chosen to cancel could make a
#: "clipped" contribution far larger than the clip. Such records are materialised instead.
_GHOST_MIN_RATIO = 0.1


def _conv2d_ghost(module: nn.Conv2d, padding: tuple[int, ...], a: torch.Tensor,
                  g: torch.Tensor) -> _LayerGrads:
    """Per-sample norms without per-sample gradients: ||sum_t g_t a_t^T||_F^2 =
    sum_{t,t'} (a_t . a_t')(g_t . g_t'); the clipped sum is then one matrix product of the
    clip-weighted output gradients with the same unfolded inputs (:func:`_summed_outer`: on
    few positions ~8x faster on this CPU than the weight-gradient convolution, 12 ms against
    98 ms for ResNet's 512->512 3x3 conv at 1x1, batch 32). Records whose
    norm is not well above float32 rounding of their terms (:data:`_GHOST_MIN_RATIO`, or not
    finite) get their gradient materialised, so norm and sum are computed from the same
    numbers."""
    batch = a.shape[0]
    columns = F.unfold(a, module.kernel_size, module.dilation, padding, module.stride)
    grads = g.reshape(batch, g.shape[1], -1)
    gram_a = torch.bmm(columns.transpose(1, 2), columns)
    gram_g = torch.bmm(grads.transpose(1, 2), grads)
    squared = (gram_a * gram_g).sum((1, 2))
    position_norms = grads.norm(dim=1)
    bound = (columns.norm(dim=1) * position_norms).sum(1)
    bias = module.bias if _trained(module.bias) else None
    if bias is not None:
        squared = squared + grads.sum(2).pow(2).sum(1)
        bound = bound + position_norms.sum(1)
    # NaN compares False: a non-finite record is materialised too (and then dropped).
    flagged = (~(squared.sqrt() >= _GHOST_MIN_RATIO * bound)).nonzero().squeeze(1)
    exact = None
    if flagged.numel():
        exact = _conv2d_materialised(module, padding, a[flagged], g[flagged])
        squared = squared.index_put((flagged,), exact.squared_norms)

    def weighted(c: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ghost_c = c if exact is None else c.index_fill(0, flagged, 0.0)
        scaled = grads * ghost_c.view(-1, 1, 1)
        out = [(module.weight, _summed_outer(scaled, columns).view_as(module.weight))]
        if bias is not None:
            out.append((bias, scaled.sum((0, 2))))
        if exact is not None:
            rest = dict((id(p), t) for p, t in exact.weighted_sums(c[flagged]))
            out = [(p, t + rest[id(p)].view_as(t)) for p, t in out]
        return out

    return _LayerGrads(squared, weighted)


def _summed_outer(grads: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """sum_b grads_b columns_b^T for (B, p, T) output gradients and (B, d, T) unfolded inputs:
    the (p, d) weight gradient of the batch, one matrix product over the B T positions."""
    batch, filters, positions = grads.shape
    return (grads.transpose(0, 1).reshape(filters, batch * positions)
            @ columns.transpose(0, 1).reshape(columns.shape[1], batch * positions).t())


def _summed_over(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` summed over ``dims``, and ``tensor`` itself when there are none: torch reads
    ``sum(())`` as a sum over every dimension, batch included."""
    return tensor.sum(dims) if dims else tensor


def _group_norm(module: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    """GroupNorm's per-sample gradients, materialised (C numbers per record and parameter).
    ``a`` and ``g`` are (B, C, *positions): the scale's gradient is the normalised input times
    the output gradient summed over positions, the shift's the output gradient summed."""
    normalised = F.group_norm(a, module.num_groups, eps=module.eps)
    return _affine_grads(module, normalised, g, tuple(range(2, a.dim())))  # none for (B, C)


def _layer_norm(module: nn.LayerNorm, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    """LayerNorm's per-sample gradients, materialised: they have the size of
    ``normalized_shape`` (a few hundred numbers per record), as small as GroupNorm's.

    ``a`` and ``g`` are (B, *positions, *normalized_shape), e.g. (B, D) for a table's hidden
    layer or (B, T, D) for a sequence; each record's gradient sums its positions: weight
    sum_t x_hat_t * g_t with x_hat the input normalised without the affine map, bias sum_t g_t.
    ``elementwise_affine=False`` (no parameters) never gets here; ``bias=False`` has no bias."""
    shape = tuple(module.normalized_shape)
    normalised = F.layer_norm(a, shape, eps=module.eps)
    # the positions between batch and shape
    return _affine_grads(module, normalised, g, tuple(range(1, a.dim() - len(shape))))


def _affine_grads(module: nn.GroupNorm | nn.LayerNorm, normalised: torch.Tensor,
                  g: torch.Tensor, positions: tuple[int, ...]) -> _LayerGrads:
    """A normalisation layer's per-sample gradients of its affine map y = w x_hat + b: the
    scale's is x_hat * g, the shift's g, each summed over the record's ``positions`` (dims
    of ``g``); a frozen or absent parameter gets none."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if _trained(module.weight):
        pairs.append((module.weight, _summed_over(normalised * g, positions)))
    if _trained(module.bias):
        pairs.append((module.bias, _summed_over(g, positions)))
    return _materialised(pairs)


def _embedding(module: nn.Embedding, a: torch.Tensor, g: torch.Tensor) -> _LayerGrads:
    """Embedding's per-sample gradients without the (B, V, D) tensor Opacus materialises.

    ``a`` holds each record's indices, (B, *positions) integers; ``g`` the output gradients,
    (B, *positions, D). Record i's gradient is zero except on the rows it used: row v gets
    sum_{t: a_it = v} g_it, and the padding row (``padding_idx``) none, as in autograd. Equal
    (record, row) pairs are grouped into one row each (at most B T rows of D numbers): the
    record's squared norm sums its rows' squares and its clipped contribution adds its rows,
    so norm and sum come from the same numbers."""
    vocabulary, dim = module.num_embeddings, module.embedding_dim
    records, grouped_rows, grouped = _rows_per_record(a.reshape(a.shape[0], -1),
                                                      g.reshape(a.shape[0], -1, dim),
                                                      vocabulary, module.padding_idx)
    squared = torch.zeros(a.shape[0], dtype=g.dtype, device=g.device).index_add_(
        0, records, grouped.pow(2).sum(1))

    def weighted(c: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        row_factors = c[records]
        scaled = grouped * row_factors[:, None]
        table = torch.zeros(vocabulary, dim, dtype=g.dtype, device=g.device)
        return [(module.weight, table.index_add_(0, grouped_rows, scaled))]

    return _LayerGrads(squared, weighted)


def _rows_per_record(indices: torch.Tensor, grads: torch.Tensor, vocabulary: int,
                     padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The nonzero rows of every record's embedding gradient. ``indices`` (B, T) and ``grads``
    (B, T, D): returns, for each distinct (record, row) pair other than the padding row, the
    record (U,), the row (U,) and the summed output gradients (U, D), U <= B T."""
    batch, positions = indices.shape
    records = torch.arange(batch, device=indices.device).repeat_interleave(positions)
    rows = indices.reshape(-1)
    flat = grads.reshape(batch * positions, -1)
    if padding_idx is not None:
        used = rows != padding_idx
        records, rows, flat = records[used], rows[used], flat[used]
    pairs, which = torch.unique(records * vocabulary + rows, return_inverse=True)
    grouped = torch.zeros(pairs.shape[0], flat.shape[1], dtype=flat.dtype,
                          device=flat.device).index_add_(0, which, flat)
    return pairs // vocabulary, pairs % vocabulary, grouped


def resolved_mode(model: nn.Module, mode: str) -> str:
    """The engine ``mode`` gives ``model`` without data: ``auto`` is layerwise when the model
    allows it, else Opacus hooks; other modes as given. (DP-SGD's ``auto`` measures hooks
    against functorch on its first records instead: :mod:`.engine_choice`.)"""
    if mode == "auto":
        return "layerwise" if layerwise_supported(model) else "hooks"
    return mode


def engine_name(model: nn.Module, mode: str) -> str:
    """The engine :func:`make_engine` gives ``model``, as the run log names it."""
    resolved = resolved_mode(model, mode)
    return "layerwise" if resolved == "layerwise" else f"Opacus ({resolved})"


def make_engine(model: nn.Module, mode: str) -> ClippedSumEngine:
    """``layerwise`` (fast path, :func:`layerwise_supported` models), ``hooks`` or ``functorch``
    (Opacus), or ``auto`` as :func:`resolved_mode` reads it."""
    mode = resolved_mode(model, mode)
    if mode == "layerwise":
        return LayerwiseEngine(model)
    return OpacusEngine(model, mode)
