"""Deep Leakage from Gradients (DLG; Zhu, Liu and Han, NeurIPS 2019) as an empirical privacy check.

The threat: a server (or anyone on the wire) holds the model a silo trained and the gradient,
or the one-step update, it released for one or a few records. DLG draws a dummy input and a
dummy soft label, and moves both by L-BFGS until the dummy's gradient matches the released one
in squared Euclidean distance; the dummy input then tends to the private record. The error of
the reconstruction (MSE to the true image, in pixels of [0, 1]) measures the leak
(docs/attacks.md).

Three releases of one true gradient ``g`` (flattened, as a privatiser sees it):

- ``none``: ``g`` itself;
- ``dpsgd``: DP-SGD's step, each record's gradient clipped to norm C, N(0, (zC)^2) added to
  their sum, divided by the batch size (for one record: clip, then Gaussian noise);
- ``dprivacy``: paper 004's SanitizeUpdate (privacy/dprivacy.py), Euclidean Laplace noise of
  norm Gamma(n, scale v ||g|| / n) in a uniform direction, applied to the update
  ``trained - received = g``.

The attacker knows the public parts of the mechanism: with DP-SGD it clips its dummy's
gradient to the same C before comparing. Without that, plain DLG fails on a clipped gradient
even with no noise at all (measured: MSE 0.25 on Fashion-MNIST, the error of a random image),
and the table would credit clipping with a protection it does not give.

Activation. DLG differentiates the gradient once more, so it needs a network whose gradient
varies smoothly with the input; the original paper replaced ReLU by sigmoid. Our CNN's ReLU
still leaks: without noise a Fashion-MNIST record comes back recognisable (MSE about 0.02,
against about 0.24 for a random image), but sigmoid brings it to about 0.002. ``--activation
sigmoid`` (:func:`attack_model`) builds that variant of the CNN for the demonstration only;
the model registry is unchanged, and a saved model is always attacked as it was trained.

Optimiser. L-BFGS with a strong Wolfe line search, where the DLG paper used fixed steps:
measured on two Fashion-MNIST records, fixed steps sometimes diverge (sigmoid CNN at v = 0.001:
MSE 0.43 where the line search reaches 0.005), which would credit the noise with the
optimiser's failure. A privacy check should use the stronger attack.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from ..models import build_model
from ..privacy.dprivacy import sanitize_update

PRIVATISERS = ("none", "dpsgd", "dprivacy")
ACTIVATIONS = ("relu", "sigmoid")
# L-BFGS evaluations per outer iteration (torch's max_iter); DLG's paper uses torch's default.
EVALUATIONS_PER_ITERATION = 20
LBFGS_HISTORY = 100


def attack_model(name: str, num_classes: int, in_channels: int, activation: str,
                 seed: int) -> nn.Module:
    """A fresh model of the registry (dpcfl_flwr.models), its ReLUs replaced by sigmoids when
    ``activation == "sigmoid"`` (the DLG paper's choice, see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    model = build_model(name, num_classes=num_classes, in_channels=in_channels, seed=seed)
    if activation == "sigmoid":
        for parent in list(model.modules()):
            for child_name, child in parent.named_children():
                if isinstance(child, nn.ReLU):
                    setattr(parent, child_name, nn.Sigmoid())
    return model.eval()


def _parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def released_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The true gradient of the mean cross-entropy loss of the batch ``(x, y)`` (1..B records)
    with respect to every trainable parameter of ``model``, detached; the model is unchanged."""
    if x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"released_gradient needs as many labels as inputs (at least one), "
                         f"got {x.shape[0]} inputs and {y.shape[0]} labels")
    loss = nn.functional.cross_entropy(model(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, _parameters(model))]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One vector of every tensor's entries, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``vector`` cut back into tensors shaped as ``like`` (the inverse of :func:`flatten`)."""
    sizes = [t.numel() for t in like]
    if vector.numel() != sum(sizes):
        raise ValueError(f"a vector of {vector.numel()} entries cannot fill tensors of "
                         f"{sum(sizes)} entries")
    return [piece.reshape(t.shape) for piece, t in zip(torch.split(vector, sizes), like,
                                                       strict=True)]


def privatise_none(per_sample: torch.Tensor) -> torch.Tensor:
    """The mean of the per-record gradients ``(B, n)``: what a non-private step releases."""
    return per_sample.mean(dim=0)


def privatise_dpsgd(per_sample: torch.Tensor, clip: float, noise_multiplier: float,
                    rng: np.random.Generator) -> torch.Tensor:
    """DP-SGD's released gradient of a batch ``(B, n)``: each row clipped to norm ``clip`` (C),
    N(0, (z C)^2) added to the sum per coordinate (z = ``noise_multiplier``), divided by B."""
    if not clip > 0 or noise_multiplier < 0:
        raise ValueError(f"DP-SGD needs a clipping norm C > 0 and a noise multiplier z >= 0, "
                         f"got C = {clip}, z = {noise_multiplier}")
    norms = per_sample.norm(dim=1, keepdim=True)
    clipped = per_sample * torch.clamp(clip / (norms + 1e-12), max=1.0)
    noise = rng.standard_normal(per_sample.shape[1]) * noise_multiplier * clip
    summed = clipped.sum(dim=0) + torch.from_numpy(noise).to(per_sample.dtype)
    return summed / per_sample.shape[0]


def privatise_dprivacy(gradient: torch.Tensor, noise_multiplier: float,
                       rng: np.random.Generator) -> torch.Tensor:
    """Paper 004's sanitised update of ``gradient`` (v = ``noise_multiplier``; v = 0 releases
    it as it is): SanitizeUpdate on ``trained = received + g``, returning ``released - received``.
    A zero received model loses nothing: the noise depends on the difference alone."""
    if noise_multiplier < 0:
        raise ValueError(f"d-privacy needs a noise multiplier v >= 0, got {noise_multiplier}")
    if noise_multiplier == 0:
        return gradient.clone()
    received = np.zeros(gradient.numel())
    trained = received + gradient.detach().double().numpy()
    sanitized = sanitize_update(trained, received, noise_multiplier, rng)
    return torch.from_numpy(sanitized.released - received).to(gradient.dtype)


def privatised_release(model: nn.Module, x: torch.Tensor, y: torch.Tensor, privatiser: str,
                       noise: float, clip: float, rng: np.random.Generator
                       ) -> list[torch.Tensor]:
    """What a silo training ``model`` one step on ``(x, y)`` releases under ``privatiser``
    (one of :data:`PRIVATISERS`; ``noise`` is z for dpsgd, v for dprivacy), as gradients."""
    if privatiser not in PRIVATISERS:
        raise ValueError(f"unknown privatiser {privatiser!r}; expected one of "
                         f"{', '.join(PRIVATISERS)}")
    like = released_gradient(model, x[:1], y[:1])
    per_sample = torch.stack([flatten(released_gradient(model, x[i:i + 1], y[i:i + 1]))
                              for i in range(x.shape[0])])
    if privatiser == "dpsgd":
        vector = privatise_dpsgd(per_sample, clip, noise, rng)
    elif privatiser == "dprivacy":
        vector = privatise_dprivacy(privatise_none(per_sample), noise, rng)
    else:
        vector = privatise_none(per_sample)
    return unflatten(vector, like)


@dataclass
class DlgResult:
    """The outcome of :func:`dlg_attack`.

    ``reconstruction`` is the dummy input (the model's input space, shape ``input_shape``);
    ``soft_label`` the dummy label's softmax ``(B, classes)``, ``label_guess`` its argmax per
    record; ``gradient_distance_history`` the squared gradient distance after each outer
    iteration (what the attacker can see: it never sees the true record);
    ``stopped_early`` says the distance became NaN or infinite and the best dummy was kept.
    """

    reconstruction: torch.Tensor
    soft_label: torch.Tensor
    label_guess: list[int]
    gradient_distance_history: list[float] = field(default_factory=list)
    iterations: int = 0
    seconds: float = 0.0
    stopped_early: bool = False

    @property
    def final_distance(self) -> float:
        return min(self.gradient_distance_history, default=math.inf)


def _dummy_gradient(model: nn.Module, params: list[nn.Parameter], dummy_x: torch.Tensor,
                    dummy_y: torch.Tensor, clip: float | None) -> list[torch.Tensor]:
    """The dummy batch's gradient, differentiable in the dummies; with ``clip`` each dummy
    record's gradient is clipped to C first and the batch mean taken (DP-SGD's public part)."""
    def one(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        soft = torch.softmax(y, dim=-1)
        loss = -(soft * torch.log_softmax(model(x), dim=-1)).sum(dim=-1).mean()
        return list(torch.autograd.grad(loss, params, create_graph=True))
    if clip is None:
        return one(dummy_x, dummy_y)
    total: list[torch.Tensor] | None = None
    for i in range(dummy_x.shape[0]):
        grads = one(dummy_x[i:i + 1], dummy_y[i:i + 1])
        norm = torch.sqrt(torch.stack([(g * g).sum() for g in grads]).sum() + 1e-12)
        scale = torch.clamp(clip / norm, max=1.0)
        grads = [g * scale for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    assert total is not None
    return [g / dummy_x.shape[0] for g in total]


def _squared_distance(dummy: Sequence[torch.Tensor], target: Sequence[torch.Tensor]
                      ) -> torch.Tensor:
    """DLG's objective: the squared Euclidean distance between two gradients."""
    return torch.stack([((d - t) ** 2).sum() for d, t in zip(dummy, target, strict=True)]).sum()


def dlg_attack(model: nn.Module, released: Sequence[torch.Tensor], input_shape: Sequence[int],
               num_classes: int, iterations: int, seed: int, *, clip: float | None = None,
               progress: Callable[[int, float], None] | None = None) -> DlgResult:
    """Reconstruct the records behind ``released`` (a gradient per trainable parameter).

    ``input_shape`` is the batch's shape ``(B, C, H, W)``; ``iterations`` outer L-BFGS steps of
    up to :data:`EVALUATIONS_PER_ITERATION` evaluations each; ``seed`` draws the dummies;
    ``clip`` (C) makes the dummy's gradient clipped as DP-SGD clips; ``progress(i, distance)``
    is called after each step. The model is copied: its parameters never change.
    """
    if iterations < 1:
        raise ValueError(f"dlg_attack needs at least one iteration, got {iterations}")
    victim = copy.deepcopy(model).eval()
    params = _parameters(victim)
    target = [t.detach() for t in released]
    if [t.shape for t in target] != [p.shape for p in params]:
        raise ValueError("the released gradient does not match the model's parameters "
                         f"({len(target)} tensors for {len(params)} parameters)")
    generator = torch.Generator().manual_seed(seed)
    dummy_x = torch.randn(tuple(input_shape), generator=generator).requires_grad_(True)
    dummy_y = torch.randn((int(input_shape[0]), num_classes),
                          generator=generator).requires_grad_(True)
    optimiser = torch.optim.LBFGS([dummy_x, dummy_y], lr=1.0,
                                  max_iter=EVALUATIONS_PER_ITERATION,
                                  history_size=LBFGS_HISTORY, tolerance_grad=0.0,
                                  tolerance_change=0.0, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        dummy = _dummy_gradient(victim, params, dummy_x, dummy_y, clip)
        distance = _squared_distance(dummy, target)
        dummy_x.grad, dummy_y.grad = torch.autograd.grad(distance, [dummy_x, dummy_y])
        return distance.detach()

    result = DlgResult(dummy_x.detach().clone(), torch.softmax(dummy_y.detach(), -1), [])
    start = time.perf_counter()
    for step in range(iterations):
        optimiser.step(closure)  # type: ignore[no-untyped-call]
        # L-BFGS returns the distance at the step's start; the attacker wants it at its end.
        distance = float(_squared_distance(
            _dummy_gradient(victim, params, dummy_x, dummy_y, clip), target).detach())
        if not math.isfinite(distance):
            result.stopped_early = True
            break
        if distance <= result.final_distance:  # the attacker keeps its best-matching dummy
            result.reconstruction = dummy_x.detach().clone()
            result.soft_label = torch.softmax(dummy_y.detach(), dim=-1)
        result.gradient_distance_history.append(distance)
        result.iterations = step + 1
        if progress is not None:
            progress(step + 1, distance)
    result.seconds = time.perf_counter() - start
    result.label_guess = [int(i) for i in result.soft_label.argmax(dim=-1)]
    return result


def _pairing(original: torch.Tensor, reconstruction: torch.Tensor) -> list[int]:
    """For each original record, the index of its reconstruction: DLG returns a batch's records
    in any order, so they are paired to minimise the total squared error (Hungarian method)."""
    errors = ((original[:, None] - reconstruction[None]) ** 2).flatten(2).mean(dim=2)
    rows, cols = linear_sum_assignment(errors.numpy())
    return [int(c) for _, c in sorted(zip(rows, cols, strict=True))]


def paired(original: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """``reconstruction`` reordered so that its i-th record is the one paired with the i-th
    original (see :func:`_pairing`); one record needs no pairing."""
    if original.shape != reconstruction.shape:
        raise ValueError(f"original {tuple(original.shape)} and reconstruction "
                         f"{tuple(reconstruction.shape)} differ in shape")
    if original.shape[0] == 1:
        return reconstruction
    return reconstruction[_pairing(original.detach(), reconstruction.detach())]


def reconstruction_error(original: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """Mean squared error between the records and their paired reconstructions, both in the
    same space (pixels in [0, 1] in this package's reports: 0 is exact, a random image of
    Fashion-MNIST scores about 0.24)."""
    return float(((original - paired(original, reconstruction)) ** 2).mean())


def psnr(original: torch.Tensor, reconstruction: torch.Tensor, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(peak^2 / MSE)`` (inf for an exact copy)."""
    mse = reconstruction_error(original, reconstruction)
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)
