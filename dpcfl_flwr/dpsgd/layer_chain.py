"""Models that are a plain chain of Linear, ReLU and Flatten layers (the table MLP, an
``nn.Sequential`` of such layers): their forward pass, and the backward pass to each trained
Linear layer's output gradient, written out by hand instead of asked of autograd.

Why: the layerwise engine (:mod:`.per_sample`) needs, for every trained layer, its input and the
gradient of the summed loss with respect to its output. Autograd gets them through forward
hooks and a graph recorded for the whole step, and on a small MLP that fixed cost per
operation is most of the step: the MLP of 18 -> 64 -> 64 -> 10 takes ~0.5 ms per
non-private step at batch 32 on this CPU. By hand, with gradients off, the step runs fewer
operations and records no graph (bench/RESULTS.md, "How fast is DP-SGD on this CPU?").

The rules (docs/algorithm.md#dp-sgd-step): the summed cross-entropy's gradient with respect to
the logits z is softmax(z) - onehot(y); a Linear layer y = a W^T + b passes g W to its input;
a ReLU passes g where its output is positive (autograd's own rule, which reads the output);
a Flatten reshapes g back to its input's shape. Each record's gradients depend on that record
only, so a record whose numbers overflow (weights chosen by the server) spoils its own row
and no other: the engine then drops it, as on the autograd path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: The layers a chain may hold; the engine needs a rule for each one's backward pass.
CHAIN_LAYERS = (nn.Linear, nn.ReLU, nn.Flatten)


class LayerChain:
    """A model's layers in the order of its forward pass (:func:`linear_chain` finds them),
    with what each step needs read once: every layer's kind and parameters, and which
    Linear layers are trained (``requires_grad``, fixed for the engine's life as its own
    parameter list is)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.kinds = ["linear" if isinstance(layer, nn.Linear) else "relu"
                      if isinstance(layer, nn.ReLU) else "flatten" for layer in self.layers]
        self.weights = {i: layer.weight for i, layer in enumerate(self.layers)
                        if isinstance(layer, nn.Linear)}
        self.biases = {i: layer.bias for i, layer in enumerate(self.layers)
                       if isinstance(layer, nn.Linear)}
        self.trained = [i for i, layer in enumerate(self.layers)
                        if isinstance(layer, nn.Linear)
                        and any(p.requires_grad for p in layer.parameters(recurse=False))]
        self._trained_set = frozenset(self.trained)  # the backward walk's membership test

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input of every layer, and last the chain's output (the logits):
        ``len(layers) + 1`` tensors, computed with gradients off (no graph)."""
        values = [x]
        with torch.no_grad():
            for index, kind in enumerate(self.kinds):
                value = values[-1]
                values.append(F.linear(value, self.weights[index], self.biases[index])
                              if kind == "linear"
                              else torch.relu(value) if kind == "relu"
                              else torch.flatten(value, 1))
        return values

    def output_grads(self, x: torch.Tensor, y: torch.Tensor
                     ) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor]]:
        """For each trained Linear layer, top layer first: the layer, its input (B, ...) and
        the gradient (B, ...) of the summed cross-entropy of the chain's logits (B, C)
        against labels ``y`` (B,) with respect to its output. The backward pass stops at the
        lowest trained layer: nothing below it is trained."""
        values = self.forward(x)
        logits = values[-1]
        if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
            raise ValueError(f"a layer chain must end in logits of shape (records, classes), "
                             f"not {tuple(logits.shape)}")
        if not self.trained:
            return []
        lowest, trained = self.trained[0], self._trained_set
        found = []
        with torch.no_grad():
            grad = torch.softmax(logits, dim=1)
            grad.scatter_add_(1, y.unsqueeze(1), torch.full(
                (y.shape[0], 1), -1.0, dtype=grad.dtype, device=grad.device))
            for index in range(len(self.kinds) - 1, lowest - 1, -1):
                kind = self.kinds[index]
                if index in trained:  # only Linear layers are ever trained
                    found.append((self.layers[index], values[index], grad))
                if index == lowest:
                    break
                # the gradient with respect to this layer's input
                grad = (grad @ self.weights[index] if kind == "linear"
                        else torch.ops.aten.threshold_backward(grad, values[index + 1], 0.0)
                        if kind == "relu" else grad.reshape(values[index].shape))
        return found


def linear_chain(model: nn.Module) -> LayerChain | None:
    """The layers, in order, whose composition is ``model``'s forward pass: an
    ``nn.Sequential``'s own (nested ones unrolled), or what a model's ``layer_chain()``
    method declares (the registry's MLP). None when the model is no such chain, or holds a
    layer other than :data:`CHAIN_LAYERS` (a Flatten only as ``flatten(x, 1)``): the engine
    then asks autograd."""
    declared = getattr(model, "layer_chain", None)
    if isinstance(model, nn.Sequential):
        layers = _unrolled(model)
    elif callable(declared):
        layers = _unrolled(nn.Sequential(*declared()))
    else:
        return None
    supported = all(isinstance(layer, CHAIN_LAYERS) and not (
        isinstance(layer, nn.Flatten) and (layer.start_dim, layer.end_dim) != (1, -1))
        for layer in layers)
    if not supported or not any(isinstance(layer, nn.Linear) for layer in layers):
        return None
    return LayerChain(layers)


def _unrolled(sequence: nn.Sequential) -> list[nn.Module]:
    return [inner for layer in sequence for inner in
            (_unrolled(layer) if isinstance(layer, nn.Sequential) else [layer])]
