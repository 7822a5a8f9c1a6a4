"""DP-SGD local training (spec §2.4-2.5) and evaluation of a model on a client's split.

One DP step: Poisson-sample a logical batch (or take all N records in the full-batch round),
compute per-sample gradients (Opacus' GradSampleModule) on physical chunks of bounded size,
clip each to norm c, add the clipped gradients up, add N(0, (z c)^2) noise once per logical
batch, divide by the expected batch size and take an SGD step. Chunking makes the full-batch
round gradient accumulation: peak memory depends on the chunk size, not on N.

Randomness that protects privacy (which records are sampled, the Gaussian noise) comes from
fresh OS entropy unless a seed is passed explicitly; a seed in a run config the server can
read would let the server subtract the noise.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
from opacus import GradSampleModule
from torch import nn

from .privacy.ledger import GaussianSteps
from .privacy.schedule import FULL_BATCH

# Per-sample gradients of one chunk hold chunk * p floats; this caps them at ~512 MiB.
_PER_SAMPLE_FLOAT_BUDGET = 128 * 1024 * 1024
_MAX_CHUNK = 512


@dataclass(frozen=True)
class DPSGDConfig:
    """Hyper-parameters of one client's local DP-SGD in one round."""

    noise_multiplier: float
    clip_norm: float
    learning_rate: float
    batch_size: int | Literal["full"]
    epochs: int = 1
    physical_batch_size: int | None = None  # None: as large as the memory budget allows
    grad_sample_mode: str = "hooks"

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0:
            raise ValueError(f"noise multiplier must be positive, got {self.noise_multiplier}")
        if self.clip_norm <= 0 or self.learning_rate <= 0 or self.epochs < 1:
            raise ValueError("clip norm and learning rate must be positive, epochs >= 1")
        if self.batch_size != FULL_BATCH and (
            not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"batch size must be a positive int or 'full', got {self.batch_size}")


@dataclass
class TrainResult:
    """What one round of local training produced: the update and the privacy it cost."""

    update: dict[str, torch.Tensor]
    entries: list[GaussianSteps]
    num_examples: int
    steps: int
    sampled_examples: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def configure_threads(num_threads: int) -> None:
    """Pin torch's intra-op threads; two threads per process on a shared 2-core VM ran ~10x
    slower than one (OpenMP contention), so every training process sets this on purpose."""
    if num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def secure_generator(seed: int | None = None) -> torch.Generator:
    """A torch generator seeded from OS entropy (or ``seed``, for reproducible tests)."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return generator


def chunk_size(model: nn.Module, requested: int | None) -> int:
    """Physical batch: the requested one, or the largest whose per-sample grads fit the budget."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"physical batch size must be >= 1, got {requested}")
        return requested
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(1, min(_MAX_CHUNK, _PER_SAMPLE_FLOAT_BUDGET // params))


def _grad_sample(p: nn.Parameter) -> torch.Tensor:
    """The per-sample gradients Opacus attached to ``p`` in the last backward pass."""
    return getattr(p, "grad_sample")  # noqa: B009 - set dynamically by Opacus' hooks


def _clear_grad_samples(params: list[nn.Parameter]) -> None:
    for p in params:
        setattr(p, "grad_sample", None)  # noqa: B010 - Opacus' dynamic attribute


def _clipped_sum(
    gsm: GradSampleModule, params: list[nn.Parameter], x: torch.Tensor, y: torch.Tensor,
    clip_norm: float, chunk: int, loss_fn: nn.Module,
) -> list[torch.Tensor]:
    """Sum over the batch of per-sample gradients clipped to ``clip_norm`` (chunk by chunk)."""
    total = [torch.zeros_like(p) for p in params]
    for start in range(0, x.shape[0], chunk):
        xb, yb = x[start:start + chunk], y[start:start + chunk]
        _clear_grad_samples(params)
        loss_fn(gsm(xb), yb).backward()
        grads = [_grad_sample(p).reshape(xb.shape[0], -1) for p in params]
        norms = torch.stack([g.pow(2).sum(dim=1) for g in grads]).sum(dim=0).sqrt()
        factors = (clip_norm / (norms + 1e-6)).clamp(max=1.0)
        for acc, g, p in zip(total, grads, params, strict=True):
            acc.add_((factors @ g).view_as(p))
    _clear_grad_samples(params)
    for p in params:
        p.grad = None
    return total


def _noisy_step(
    params: list[nn.Parameter], clipped: list[torch.Tensor], config: DPSGDConfig,
    expected_batch: float, noise: torch.Generator,
) -> None:
    """theta <- theta - lr * (sum of clipped grads + N(0, (z c)^2 I)) / expected batch."""
    std = config.noise_multiplier * config.clip_norm
    with torch.no_grad():
        for p, g in zip(params, clipped, strict=True):
            g.add_(torch.normal(0.0, std, size=g.shape, generator=noise))
            p.add_(g, alpha=-config.learning_rate / expected_batch)


# Inputs never require gradients here, so torch warns on every backward that the first
# layer's full backward hook sees only output gradients; that is exactly what Opacus needs.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def _wrap(model: nn.Module, mode: str) -> GradSampleModule:
    if mode not in ("hooks", "functorch"):
        raise ValueError(f"grad_sample_mode must be 'hooks' or 'functorch', got {mode!r}")
    return GradSampleModule(
        model, batch_first=True, loss_reduction="sum", force_functorch=(mode == "functorch")
    )


def train_dp(
    model: nn.Module, x_train: torch.Tensor, y_train: torch.Tensor, config: DPSGDConfig,
    *, round_number: int | None = None, seed: int | None = None,
) -> TrainResult:
    """Run one round of local DP-SGD on ``model`` in place; return its update and cost.

    Rounds with an integer batch b run K * ceil(N/b) steps at Poisson rate b/N; the full-batch
    round runs K steps on all N records (rate 1). ``seed`` fixes sampling and noise (tests).
    """
    n = int(x_train.shape[0])
    if n == 0 or y_train.shape[0] != n:
        raise ValueError(f"need matching, non-empty data (x: {n}, y: {y_train.shape[0]})")
    full = config.batch_size == FULL_BATCH
    batch = n if full else int(config.batch_size)
    if batch > n:
        raise ValueError(f"batch size {batch} exceeds the client's {n} training samples")
    rate = batch / n
    steps = config.epochs * (1 if full else math.ceil(n / batch))
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gsm = _wrap(model, config.grad_sample_mode)
    params = [p for p in model.parameters() if p.requires_grad]
    chunk = chunk_size(model, config.physical_batch_size)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    sampler, noise = secure_generator(seed), secure_generator(None if seed is None else seed + 1)
    model.train()
    sampled = 0
    try:
        for _ in range(steps):
            if full:
                xb, yb = x_train, y_train
            else:
                mask = torch.rand(n, generator=sampler) < rate
                xb, yb = x_train[mask], y_train[mask]
            sampled += int(xb.shape[0])
            clipped = _clipped_sum(gsm, params, xb, yb, config.clip_norm, chunk, loss_fn)
            _noisy_step(params, clipped, config, rate * n, noise)
    finally:
        gsm.cleanup()
    update = {k: (v.detach() - start[k]) for k, v in model.state_dict().items()}
    entry = GaussianSteps(config.noise_multiplier, rate, steps, round_number)
    return TrainResult(update, [entry], n, steps, sampled)


@torch.inference_mode()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (a fraction in [0, 1]) of ``model`` on (x, y)."""
    if x.shape[0] == 0:
        raise ValueError("cannot evaluate on an empty split")
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start:start + batch_size])
        target = y[start:start + batch_size]
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    return loss_sum / x.shape[0], correct / x.shape[0]
