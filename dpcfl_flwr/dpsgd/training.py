"""DP-SGD local training and evaluation of a model on a client's split.

docs/algorithm.md#dp-sgd-step states the step (A1), the steps of a round (A2) and their noise
(A3).

One DP step: Poisson-sample a logical batch (or take all N records in the full-batch round),
compute per-sample gradients (:mod:`dpcfl_flwr.dpsgd.per_sample`) on physical chunks of bounded
size, clip each to norm c, add the clipped gradients up, add N(0, (z c)^2) noise once per logical
batch, divide by the expected batch size and take an SGD step. Chunking makes the full-batch
round gradient accumulation: peak memory depends on the chunk size, not on N.

Randomness that protects privacy (which records are sampled, the Gaussian noise) comes from
fresh OS entropy unless a seed is passed explicitly; a seed in a run config the server can
read would let the server subtract the noise.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..data.records import Inputs, in_memory
from ..privacy.ledger import GaussianSteps
from ..privacy.metrics import SCORE_BINS, EvaluationSums, score_bins
from ..privacy.schedule import FULL_BATCH
from .engine_choice import EngineChoice, by_rule, choose
from .per_sample import ClippedSumEngine, activation_floats, engine_name, make_engine

logger = logging.getLogger(__name__)

# Per-sample gradients of one chunk hold chunk * p floats; this caps them at ~512 MiB.
_PER_SAMPLE_FLOAT_BUDGET = 128 * 1024 * 1024
# An engine that reports its floats per record (the layerwise one) gets chunks of ~32 MiB, its
# own floats and the activations counted (:func:`chunk_size`), but never fewer than
# :data:`_MIN_CHUNK` records while they fit ~128 MiB: below ~30 records a chunk's products get
# slow. The quick example's CNN runs its full-batch round (375 records) in chunks of 59: the
# step took 1.05-1.1x the time of chunks of 236 (~128 MiB) and its peak was ~90 MB lower
# (1,000 records, one thread, interleaved, 2026-11-27); 21 silos take that step at the same
# moment. ResNet-18-GN (CIFAR-10) keeps chunks of 28 (~128 MiB): at 7 (~32 MiB) its step
# took 1.5x the time for ~15 MB less.
_CHUNK_FLOAT_BUDGET = 8 * 1024 * 1024
_CHUNK_FLOAT_CEILING = 32 * 1024 * 1024
_MIN_CHUNK = 32
#: What a chunk holds per float of a record's activations (the forward outputs): the outputs,
#: what autograd keeps for the backward pass, and their gradients.
_ACTIVATION_COPIES = 3
_MAX_CHUNK = 512
#: Most records per chunk under the memory rule that counts what the engine holds per record,
#: above :data:`_MAX_CHUNK` for a small model whose records cost little memory: the table
#: MLP's full-batch step on 4,096 records ran at 0.56x non-private SGD in chunks of 512 and
#: 0.75x in chunks of 1,024 or 2,048, each chunk paying the step's fixed costs (one thread,
#: one process, 2026-11-27).
_MAX_BUDGETED_CHUNK = 2048
#: Records per forward pass of an evaluation. The quick example's test split (1,667 records,
#: the paper's CNN) took 0.73x the time in batches of 256 as in batches of 1,024, and its
#: peak memory was 33 MiB above the model's instead of 98 (one thread, 2026-11-27).
EVALUATION_BATCH = 256


@dataclass(frozen=True)
class DPSGDConfig:
    """Hyper-parameters of one client's local DP-SGD in one round."""

    noise_multiplier: float
    clip_norm: float
    learning_rate: float
    batch_size: int | Literal["full"]
    epochs: int = 1
    physical_batch_size: int | None = None  # None: as large as the memory budget allows
    grad_sample_mode: str = "auto"  # layerwise when the model allows it (bench/RESULTS.md)

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
    engine: EngineChoice | None = None  # the per-sample engine DP-SGD used, and why


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


def chunk_size(model: nn.Module, requested: int | None,
               floats_per_record: int | None = None, activations: int = 0) -> int:
    """Physical batch: the requested one, or the largest whose per-record floats fit a
    budget. With ``floats_per_record`` (what the engine holds per record) and ``activations``
    (:func:`.per_sample.activation_floats`): those floats plus the activations' copies, in
    :data:`_CHUNK_FLOAT_BUDGET`, or :data:`_MIN_CHUNK` records where that is fewer and they
    fit :data:`_CHUNK_FLOAT_CEILING`, at most :data:`_MAX_BUDGETED_CHUNK`. Without: one
    gradient per record (what materialising every per-sample gradient holds) in
    :data:`_PER_SAMPLE_FLOAT_BUDGET`, at most :data:`_MAX_CHUNK`."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"physical batch size must be >= 1, got {requested}")
        return requested
    if floats_per_record is None:
        per_gradient = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return max(1, min(_MAX_CHUNK, _PER_SAMPLE_FLOAT_BUDGET // max(1, per_gradient)))
    per_record = max(1, floats_per_record + _ACTIVATION_COPIES * activations)
    floor = min(_MIN_CHUNK, _CHUNK_FLOAT_CEILING // per_record)
    return max(1, floor, min(_MAX_BUDGETED_CHUNK, _CHUNK_FLOAT_BUDGET // per_record))


def _clipped_sum(
    engine: ClippedSumEngine, params: list[torch.Tensor], x: Inputs, y: torch.Tensor,
    clip_norm: float, chunk: int,
) -> list[torch.Tensor]:
    """Sum over the batch of per-sample gradients clipped to ``clip_norm``, chunk by chunk
    (gradient accumulation: memory is bounded by the chunk, not by the batch)."""
    if x.shape[0] == 0:  # Poisson sampling may draw no record: the step is noise alone
        return [torch.zeros_like(p) for p in params]
    if x.shape[0] <= chunk:  # the common Poisson step: one chunk, nothing to accumulate
        return engine.clipped_sum(in_memory(x), y, clip_norm)
    total = [torch.zeros_like(p) for p in params]
    for start in range(0, x.shape[0], chunk):
        for acc, part in zip(total, engine.clipped_sum(x[start:start + chunk],
                                                       y[start:start + chunk], clip_norm),
                             strict=True):
            acc.add_(part)
    return total


class GaussianNoise:
    """N(0, std^2 I) noise for every trained parameter, drawn in one call: one flat buffer
    per dtype and device, with a view shaped like each parameter, made once per stepper.
    Per tensor, a step's noise and update were 18 calls on the table MLP's 6 tensors (~75 us
    of a ~500 us step on this CPU); here they are three, whatever the number of tensors."""

    def __init__(self, params: list[torch.Tensor], generator: torch.Generator) -> None:
        self.generator = generator
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, p in enumerate(params):
            groups.setdefault((p.dtype, p.device), []).append(index)
        self.buffers: list[torch.Tensor] = []
        views: dict[int, torch.Tensor] = {}
        for (dtype, device), members in groups.items():
            flat = torch.empty(sum(params[i].numel() for i in members), dtype=dtype,
                               device=device)
            pieces = flat.split([params[i].numel() for i in members])
            views.update({i: piece.view_as(params[i]) for i, piece in zip(members, pieces,
                                                                          strict=True)})
            self.buffers.append(flat)
        self.views = [views[i] for i in range(len(params))]

    def add_to(self, tensors: list[torch.Tensor], std: float) -> None:
        """Add fresh noise of standard deviation ``std`` to ``tensors`` (shaped like the
        parameters, in their order), in place."""
        for flat in self.buffers:
            flat.normal_(0.0, std, generator=self.generator)
        torch._foreach_add_(tensors, self.views)


def _noisy_step(
    params: list[torch.Tensor], clipped: list[torch.Tensor], config: DPSGDConfig, std: float,
    expected_batch: float, noise: GaussianNoise, prox: ProxTerm | None,
) -> None:
    """theta <- theta - lr * ((sum of clipped grads + N(0, std^2 I)) / expected batch
    + lambda (theta - anchor)), std = z c; the proximal term is data-independent, so adding it
    after privatisation is free (post-processing) and, unlike a loss term, is not lost in
    clipping."""
    with torch.no_grad():
        if std > 0:
            noise.add_to(clipped, std)
        if prox is None:
            # one call for every tensor, as torch.optim's foreach SGD
            torch._foreach_add_(params, clipped, alpha=-config.learning_rate / expected_batch)
            return
        for index, (p, g) in enumerate(zip(params, clipped, strict=True)):
            g.div_(expected_batch).add_(p - prox.anchor[index], alpha=prox.strength)
            p.add_(g, alpha=-config.learning_rate)


@dataclass(frozen=True)
class AuditHook:
    """What the privacy audit (:mod:`dpcfl_flwr.audit`) adds to a round of DP-SGD.

    ``canaries(rate)`` returns the summed clipped gradients of the audit's canary records that
    Poisson sampling at ``rate`` puts into this step, added to the batch's before the noise;
    ``noiseless`` leaves the noise out: the broken privatiser the audit must catch. Only the
    audit builds one. Silos never pass it and DPSGDConfig still refuses z <= 0, so no run
    config or train message can switch the noise off.
    """

    canaries: Callable[[float], list[torch.Tensor]]
    noiseless: bool = False


@dataclass(frozen=True)
class ProxTerm:
    """MR-MTL's mean regulariser (lambda / 2) ||theta - anchor||^2, anchor aligned with the
    model's trainable parameters."""

    strength: float
    anchor: list[torch.Tensor]

    @classmethod
    def for_model(cls, model: nn.Module, strength: float,
                  anchor: dict[str, torch.Tensor]) -> ProxTerm:
        return cls(strength, [anchor[name].detach().to(p.dtype)
                              for name, p in model.named_parameters() if p.requires_grad])


def round_cost(
    num_samples: int, batch_size: int | Literal["full"], epochs: int, noise_multiplier: float,
    round_number: int | None = None,
) -> GaussianSteps:
    """The SGM steps one round of :func:`train_dp` runs: K * ceil(N/b) steps at rate b/N, or
    K steps at rate 1 for the full batch. Silos charge exactly this before they train."""
    batch = num_samples if batch_size == FULL_BATCH else int(batch_size)
    if batch > num_samples:
        raise ValueError(f"batch size {batch} exceeds the client's {num_samples} training samples")
    steps = epochs * math.ceil(num_samples / batch)
    return GaussianSteps(noise_multiplier, batch / num_samples, steps, round_number)


class DPSGDStepper:
    """The per-step machinery of local DP-SGD on one model (engine hooks, noise source, chunk
    size), set up once so a round's steps, and the benchmark's paired steps, share it."""

    def __init__(
        self, model: nn.Module, config: DPSGDConfig, expected_batch: float, *,
        noise_seed: int | None = None, prox: ProxTerm | None = None,
        audit: AuditHook | None = None,
    ) -> None:
        self.config, self.expected_batch, self.prox = config, expected_batch, prox
        noiseless = audit is not None and audit.noiseless
        self.noise_std = 0.0 if noiseless else config.noise_multiplier * config.clip_norm
        self.model = model
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.noise = GaussianNoise(self.params, secure_generator(noise_seed))
        # Engine and chunk are set on the first records: ``auto`` may measure the engines on
        # them (engine_choice), and the chunk follows the engine's per-record memory.
        self.engine: ClippedSumEngine | None = None
        self.choice: EngineChoice | None = None
        self.chunk: int | None = None
        mode = config.grad_sample_mode
        self.choice = by_rule(model) if mode == "auto" else EngineChoice(mode, "asked for by name")
        if self.choice is not None:
            self.engine = make_engine(model, self.choice.mode)

    def _setup(self, x: Inputs, y: torch.Tensor) -> tuple[ClippedSumEngine, int]:
        """The engine and chunk size, chosen on the first non-empty batch (x, y)."""
        requested = self.config.physical_batch_size
        if self.engine is None:
            first = chunk_size(self.model, requested)  # what the Opacus engines hold
            self.choice = choose(self.model, in_memory(x[:first]), y[:first],
                                 self.config.clip_norm)
            self.engine = make_engine(self.model, self.choice.mode)
        if self.chunk is None:
            floats = activations = None
            if requested is None:
                one = in_memory(x[:1])
                floats = self.engine.floats_per_record(one)
                activations = activation_floats(self.model, one)
            self.chunk = chunk_size(self.model, requested, floats, activations or 0)
            if requested is None and isinstance(self.config.batch_size, int):
                # A Poisson batch stays one chunk (it tops twice its mean with negligible
                # probability): splitting ResNet-18-GN's batches of ~32 into chunks of 28
                # and a few records would run a second, nearly empty pass. The memory rule
                # is for the full-batch round.
                self.chunk = max(self.chunk, min(_MAX_CHUNK, 2 * self.config.batch_size))
            logger.debug("DP-SGD with the %s engine (%s), chunks of %d",
                         engine_name(self.model, self.choice.mode) if self.choice else "?",
                         self.choice.reason if self.choice else "", self.chunk)
        return self.engine, self.chunk

    def step(self, x: Inputs, y: torch.Tensor,
             extra: list[torch.Tensor] | None = None) -> None:
        """One noisy SGD step on the logical batch (x, y), plus ``extra`` clipped gradients
        (the audit's canaries) summed in before the noise."""
        if x.shape[0] == 0:  # Poisson sampling may draw no record: the step is noise alone
            clipped = [torch.zeros_like(p) for p in self.params]
        else:
            engine, chunk = self._setup(x, y)
            clipped = _clipped_sum(engine, self.params, x, y, self.config.clip_norm, chunk)
        if extra is not None:
            for acc, part in zip(clipped, extra, strict=True):
                acc.add_(part)
        _noisy_step(self.params, clipped, self.config, self.noise_std, self.expected_batch,
                    self.noise, self.prox)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def train_dp(
    model: nn.Module, x_train: Inputs, y_train: torch.Tensor, config: DPSGDConfig,
    *, round_number: int | None = None, seed: int | None = None,
    prox: tuple[float, dict[str, torch.Tensor]] | None = None, audit: AuditHook | None = None,
) -> TrainResult:
    """Run one round of local DP-SGD on ``model`` in place; return its update and cost.

    Rounds with an integer batch b run K * ceil(N/b) steps at Poisson rate b/N; the full-batch
    round runs K steps on all N records (rate 1). ``seed`` fixes sampling and noise (tests).
    ``prox`` = (lambda, anchor weights) adds MR-MTL's proximal term to every step; ``audit``
    is the privacy audit's hook (:class:`AuditHook`), never set in a silo.
    """
    n = int(x_train.shape[0])
    if n == 0 or y_train.shape[0] != n:
        raise ValueError(f"need matching, non-empty data (x: {n}, y: {y_train.shape[0]})")
    cost = round_cost(n, config.batch_size, config.epochs, config.noise_multiplier, round_number)
    full, rate, steps = cost.sample_rate == 1.0, cost.sample_rate, cost.steps
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prox_term = None if prox is None else ProxTerm.for_model(model, prox[0], prox[1])
    stepper = DPSGDStepper(model, config, rate * n, prox=prox_term, audit=audit,
                           noise_seed=None if seed is None else seed + 1)
    sampler = secure_generator(seed)
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
            stepper.step(xb, yb, None if audit is None else audit.canaries(rate))
    finally:
        stepper.close()
    update = {k: (v.detach() - start[k]) for k, v in model.state_dict().items()}
    return TrainResult(update, [cost], n, steps, sampled, engine=stepper.choice)


def train_sgd(model: nn.Module, x_train: Inputs, y_train: torch.Tensor,
              learning_rate: float, batch_size: int, epochs: int = 1,
              seed: int | None = None) -> dict[str, torch.Tensor]:
    """Plain (not private) local SGD on ``model`` in place: ``epochs`` passes over the records
    in shuffled batches of ``batch_size``; returns the update. What leaves the silo must then
    be privatised otherwise (d-privacy's sanitiser, docs/dprivacy.md).

    A record whose loss or gradient is not finite (weights the server chose to overflow on it)
    contributes nothing to its batch's step (:func:`_finite_records_gradient`)."""
    n = int(x_train.shape[0])
    if n == 0 or y_train.shape[0] != n or batch_size < 1 or learning_rate <= 0:
        raise ValueError("need non-empty data, a positive batch size and learning rate")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    shuffler = secure_generator(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=shuffler)
        for first in range(0, n, batch_size):
            rows = order[first:first + batch_size]
            grads = _finite_records_gradient(model, params, x_train[rows], y_train[rows])
            with torch.no_grad():
                for p, grad in zip(params, grads, strict=True):
                    p.add_(grad, alpha=-learning_rate)
    return {k: (v.detach() - start[k]) for k, v in model.state_dict().items()}


def _finite_records_gradient(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor,
                             y: torch.Tensor) -> list[torch.Tensor]:
    """The mean cross-entropy gradient of a batch over its records whose gradient is finite
    (the others count as zero, the mean is still over the whole batch). One ordinary backward
    pass when it comes out finite; otherwise per-record gradients drop the non-finite records
    (0 x inf is NaN, so masking the loss alone cannot remove a record from the backward)."""
    for p in params:
        p.grad = None
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    finite = torch.isfinite(losses)
    (torch.where(finite, losses, torch.zeros_like(losses)).sum() / x.shape[0]).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    if all(bool(torch.isfinite(grad).all()) for grad in grads):
        return grads
    engine = make_engine(model, "auto")
    try:
        sums = engine.clipped_sum(x, y, math.inf)
    finally:
        engine.close()
    return [total / x.shape[0] for total in sums]


def bounded_losses(losses: torch.Tensor, loss_bound: float) -> torch.Tensor:
    """Per-record losses in [0, ``loss_bound``]: a loss that is not finite (NaN, or inf from
    weights that overflow on one record) counts as ``loss_bound``, never as NaN, so one record
    moves a sum of them by at most the bound."""
    bounded = losses.clamp(min=0.0, max=loss_bound)
    return torch.where(torch.isfinite(losses), bounded, torch.full_like(losses, loss_bound))


class _Tally:
    """The running sums of :func:`classification_sums` over ``classes`` classes."""

    def __init__(self, classes: int, loss_bound: float) -> None:
        self.loss_bound, self.loss_sum, self.correct = loss_bound, 0.0, 0
        self.class_correct = torch.zeros(classes, dtype=torch.long)
        self.class_count = torch.zeros(classes, dtype=torch.long)
        self.histogram = torch.zeros((2, SCORE_BINS), dtype=torch.long) if classes == 2 else None

    def add(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        losses = nn.functional.cross_entropy(logits, target, reduction="none")
        # summed in float64: a float32 sum's rounding would let one record move it by more
        # than its own (bounded) loss, past the sensitivity the release is charged for
        self.loss_sum += float(bounded_losses(losses.double(), self.loss_bound).sum())
        right = logits.argmax(dim=1) == target
        self.correct += int(right.sum())
        classes = len(self.class_count)
        self.class_correct += torch.bincount(target[right], minlength=classes)
        self.class_count += torch.bincount(target, minlength=classes)
        if self.histogram is not None:
            bins = score_bins(torch.softmax(logits.double(), dim=1)[:, 1])
            self.histogram += torch.bincount(target * SCORE_BINS + bins,
                                             minlength=2 * SCORE_BINS).reshape(2, SCORE_BINS)

    def sums(self, count: int) -> EvaluationSums:
        return EvaluationSums(count, self.correct, self.loss_sum, self.class_correct.numpy(),
                              self.class_count.numpy(),
                              None if self.histogram is None else self.histogram.numpy())


@torch.inference_mode()
def classification_sums(
    model: nn.Module, x: Inputs, y: torch.Tensor, num_classes: int | None = None,
    loss_bound: float = math.inf, batch_size: int = EVALUATION_BATCH,
) -> EvaluationSums:
    """Every sum an evaluation reports (:class:`~..privacy.metrics.EvaluationSums`, exact):
    per-record cross-entropy (nats, each in [0, ``loss_bound``], a non-finite one counted as
    the bound: :func:`bounded_losses`), correct predictions overall and per true class, the
    records of each class and, for two classes, each class's histogram of positive-class
    scores. One record adds to each sum at most once, whatever the weights (the sensitivity
    docs/privacy.md#private-evaluation-metrics charges). ``num_classes``: K (None: the
    width of the model's output)."""
    if x.shape[0] == 0:
        raise ValueError("cannot evaluate on an empty split")
    model.eval()
    tally: _Tally | None = None
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start:start + batch_size])
        if tally is None:
            tally = _Tally(num_classes or int(logits.shape[1]), loss_bound)
        tally.add(logits, y[start:start + batch_size])
    assert tally is not None  # the split is not empty
    return tally.sums(int(x.shape[0]))


def evaluation_sums(
    model: nn.Module, x: Inputs, y: torch.Tensor, loss_bound: float = math.inf,
    batch_size: int = EVALUATION_BATCH,
) -> tuple[float, int]:
    """Sum of per-record cross-entropy (nats, each in [0, ``loss_bound``]) and the number of
    correct predictions of ``model`` on (x, y) (:func:`classification_sums`)."""
    sums = classification_sums(model, x, y, None, loss_bound, batch_size)
    return sums.loss_sum, int(sums.correct)


def evaluate(
    model: nn.Module, x: Inputs, y: torch.Tensor, batch_size: int = EVALUATION_BATCH
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (a fraction in [0, 1]) of ``model`` on (x, y)."""
    loss_sum, correct = evaluation_sums(model, x, y, batch_size=batch_size)
    return loss_sum / x.shape[0], correct / x.shape[0]
