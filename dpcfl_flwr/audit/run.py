"""One audit run: a silo's DP-SGD with gradient canaries, the membership test, the bound.

Design (docs/privacy.md#auditing-the-guarantee). We use the one-run audit
of Steinke, Nasr & Jagielski (2023) rather than many runs with Clopper-Pearson bounds on
TPR / FPR: one training run gives m independent membership trials at once, where the classic
audit needs hundreds of runs for the same statistical strength, which a CPU cannot afford.
The canaries are gradient canaries (:mod:`.canaries`): the white-box setting, the strongest
one-run audit and the cheapest, since a canary costs one vector entry per step, no forward or
backward pass.

What is audited is our training path itself: :func:`dpcfl_flwr.dpsgd.training.train_dp`, round after
round, with its Poisson sampling, per-sample clipping and noise at the silo's z; the canaries
enter through its :class:`~dpcfl_flwr.dpsgd.training.AuditHook`, summed with the batch's clipped
gradients before the noise. The claimed epsilon is what our accountant charges for exactly the
steps the run took (the ledger entries train_dp returned). ``noiseless`` switches the noise
off while the claim stays that of z: a broken privatiser the audit must catch.

A one-run audit is a lower bound and a loose one: on correct DP-SGD it stays well below the
accountant's figure (Steinke et al. report the same gap); what it proves is a floor, so a bound
above the claim means the implementation leaks more than it says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from ..dpsgd.training import AuditHook, DPSGDConfig, round_cost, train_dp
from ..privacy.accountants import AccountantName, accountant_named
from ..privacy.history import History
from ..privacy.schedule import GaussianPhase
from .bound import audit_bound
from .canaries import DiracCanaries, flat_parameters, guess_membership

Progress = Callable[[int, int], None]  # (rounds done, rounds in all)


@dataclass(frozen=True)
class AuditSettings:
    """A silo's DP-SGD as audited, and the audit's own parameters.

    ``guesses`` is k+ = k-, the number of "in" and of "out" guesses (None: a tenth of the
    canaries each), fixed before training as the test requires."""

    noise_multiplier: float
    batch_size: int
    clip_norm: float = 1.0
    learning_rate: float = 0.1
    rounds: int = 1
    epochs: int = 1
    canaries: int = 1000
    guesses: int | None = None
    confidence: float = 0.95
    delta: float = 1e-5
    accountant: AccountantName = "pld"
    noiseless: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.canaries < 1:
            raise ValueError("rounds and canaries must be >= 1")
        if 2 * self.guesses_each > self.canaries or self.guesses_each < 1:
            raise ValueError(f"{self.guesses} guesses each way need 1 <= 2 x guesses <= "
                             f"{self.canaries} canaries")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")

    @property
    def guesses_each(self) -> int:
        return self.guesses if self.guesses is not None else max(1, self.canaries // 10)


@dataclass(frozen=True)
class AuditResult:
    """What an audit found: the accountant's claim and the audit's lower bound on epsilon."""

    claimed_epsilon: float
    lower_bound: float
    guesses: int
    correct: int
    correct_in: int
    correct_out: int
    canaries_in: int
    canaries_never_sampled: int
    steps: int
    sample_rate: float
    records: int
    parameters: int
    seconds: float
    settings: AuditSettings

    @property
    def passed(self) -> bool:
        """The audit found no contradiction: its lower bound is at most the claim."""
        return self.lower_bound <= self.claimed_epsilon

    def to_dict(self) -> dict[str, object]:
        return {**{k: v for k, v in asdict(self).items() if k != "settings"},
                "passed": self.passed, "settings": asdict(self.settings)}


def noise_for_epsilon(records: int, settings: AuditSettings, target_epsilon: float) -> float:
    """The z at which the audited schedule (``rounds`` x ``epochs`` x ceil(N / b) steps at
    rate b / N) spends ``target_epsilon`` at the settings' delta, by its accountant."""
    cost = round_cost(records, settings.batch_size, settings.epochs, 1.0)
    phases = [GaussianPhase(cost.sample_rate, cost.steps * settings.rounds)]
    return accountant_named(settings.accountant).calibrate(phases, target_epsilon,
                                                           settings.delta)


def run_audit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: AuditSettings,
              *, seed: int | None = None, progress: Progress | None = None) -> AuditResult:
    """Train ``model`` in place on (x, y) plus the canaries for ``settings.rounds`` rounds of
    our DP-SGD, test membership, and bound epsilon from below (module docstring).

    ``seed`` fixes the canaries, sampling and noise (tests, reproducible benches); None draws
    them all from OS entropy."""
    started = time.perf_counter()
    config = DPSGDConfig(settings.noise_multiplier, settings.clip_norm, settings.learning_rate,
                         settings.batch_size, settings.epochs)
    canaries = DiracCanaries(model, settings.canaries, settings.clip_norm,
                             np.random.default_rng(seed))
    hook = AuditHook(canaries.clipped_sum, noiseless=settings.noiseless)
    start = flat_parameters(model)
    runs: list[tuple[float, float, float]] = []
    for index in range(settings.rounds):
        round_seed = None if seed is None else seed + 2 * index + 1
        result = train_dp(model, x, y, config, round_number=index + 1, seed=round_seed,
                          audit=hook)
        runs += [(e.noise_multiplier, e.sample_rate, e.steps) for e in result.entries]
        if progress is not None:
            progress(index + 1, settings.rounds)
    scores = canaries.scores(start, flat_parameters(model))
    each = settings.guesses_each
    guesses = guess_membership(scores, canaries.included, each, each)
    claimed = accountant_named(settings.accountant).epsilon(History(tuple(runs)),
                                                            settings.delta)
    bound = audit_bound(canaries.count, guesses.made, guesses.correct, settings.delta,
                        settings.confidence)
    return AuditResult(
        claimed_epsilon=claimed, lower_bound=bound, guesses=guesses.made,
        correct=guesses.correct, correct_in=guesses.correct_in,
        correct_out=guesses.correct_out, canaries_in=int(canaries.included.sum()),
        canaries_never_sampled=int(np.sum(canaries.included & (canaries.draws == 0))),
        steps=int(sum(steps for _, _, steps in runs)), sample_rate=runs[0][1],
        records=int(x.shape[0]), parameters=canaries.dimension,
        seconds=time.perf_counter() - started, settings=settings)
