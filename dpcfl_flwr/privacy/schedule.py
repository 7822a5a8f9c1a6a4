"""DP-SGD schedules: which sampled-Gaussian steps a client will run over a whole training.

A schedule is a list of phases, each a number of SGM steps at one sampling rate; every phase
uses the same noise multiplier z (paper §5; docs/privacy.md#schedules, P3).
R-DPCFL runs two phases (round 1 at rate 1 with the full batch, then rounds 2..E at rate b/N);
the baselines run one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .defaults import BudgetMode, Conversion
from .history import DEFAULT_ACCOUNTANT, UNNAMED_ACCOUNTANT, AccountantName
from .rdp import DEFAULT_ORDERS, sgm_rdp

FULL_BATCH = "full"
#: The most learning rates a run may propose to choose among: the round that chooses trains
#: one model per candidate, so this bounds its work (a silo refuses more).
MAX_TUNED_RATES = 8
#: The budget share of the learning rate's private choice in a schedule that plans no other
#: selection (the baselines'); R-DPCFL's choice takes its selections' share, 3% by default.
TUNING_SELECT_RATIO = 0.03


def check_candidates(rates: tuple[float, ...]) -> None:
    """ValueError unless ``rates`` is empty or 2..MAX_TUNED_RATES positive learning rates."""
    if rates and not (2 <= len(rates) <= MAX_TUNED_RATES and min(rates) > 0):
        raise ValueError(f"give 2 to {MAX_TUNED_RATES} positive learning rates")


@dataclass(frozen=True)
class GaussianPhase:
    """``steps`` SGM steps at Poisson rate ``sample_rate`` (steps may be fractional only in
    the authors' planning formula, never in what a client executes)."""

    sample_rate: float
    steps: float

    def rdp(self, noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
        return sgm_rdp(self.sample_rate, noise_multiplier, self.steps, orders)


def steps_per_round(num_samples: int, batch_size: int, epochs: int, exact: bool = True) -> float:
    """SGM steps one client runs in one round of K epochs at expected batch size b.

    Executed training runs ceil(N/b) Poisson steps per epoch (docs/algorithm.md#dp-sgd-step,
    A2). ``exact=False``
    gives the authors' planning formula K*N/b (a real number), used to reproduce their tables.
    """
    if batch_size <= 0 or num_samples <= 0 or epochs <= 0:
        raise ValueError("samples, batch size and epochs must be positive")
    if batch_size > num_samples:
        raise ValueError(f"batch size {batch_size} exceeds the {num_samples} samples")
    per_epoch = math.ceil(num_samples / batch_size) if exact else num_samples / batch_size
    return epochs * per_epoch


def round_phase(
    num_samples: int, batch_size: int | str, epochs: int, rounds: int = 1, exact: bool = True
) -> GaussianPhase:
    """The phase of ``rounds`` rounds at batch ``batch_size`` (an int or ``"full"``)."""
    if batch_size == FULL_BATCH:
        batch_size = num_samples
    if not isinstance(batch_size, int):
        raise ValueError(f"batch size must be an int or {FULL_BATCH!r}, got {batch_size!r}")
    rate = batch_size / num_samples
    return GaussianPhase(rate, rounds * steps_per_round(num_samples, batch_size, epochs, exact))


def single_stage_schedule(
    num_samples: int, batch_size: int, epochs: int, rounds: int, exact: bool = True
) -> list[GaussianPhase]:
    """The baselines' schedule: every one of the E rounds at batch b (the authors'
    ``compute_z``; docs/privacy.md#schedules)."""
    return [round_phase(num_samples, batch_size, epochs, rounds, exact)]


def two_stage_schedule(
    num_samples: int, batch_size: int, epochs: int, rounds: int,
    first_batch: int | str = FULL_BATCH, exact: bool = True,
) -> list[GaussianPhase]:
    """R-DPCFL's schedule: round 1 at batch b^1 (default full, rate 1), rounds 2..E at b^{>1}."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    first = round_phase(num_samples, first_batch, epochs, 1, exact)
    if rounds == 1:
        return [first]
    return [first, round_phase(num_samples, batch_size, epochs, rounds - 1, exact)]


def tuning_phases(num_samples: int, batch_size: int | str, epochs: int,
                  candidates: int) -> list[GaussianPhase]:
    """The steps a learning-rate choice among ``candidates`` adds to a schedule: the round
    that chooses trains one model per candidate, where the schedule counted one."""
    if candidates < 2:
        return []
    return [round_phase(num_samples, batch_size, epochs, candidates - 1)]


def schedule_rdp(
    phases: Sequence[GaussianPhase], noise_multiplier: float,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> np.ndarray:
    """RDP curve of a whole schedule at noise multiplier z (RDP adds under composition)."""
    total = np.zeros(len(orders))
    for phase in phases:
        total = total + phase.rdp(noise_multiplier, orders)
    return total


@dataclass(frozen=True)
class Schedule:
    """The whole DP-SGD schedule the server proposes; the silo calibrates z for it once.

    Sizes are counts (rounds, epochs, records per batch, selections); ``select_ratio`` is the
    share of the budget each private selection spends (docs/privacy.md)."""

    rounds: int
    local_epochs: int
    batch_size: int
    first_batch: int | Literal["full"]
    select_rounds: int
    select_ratio: float
    conversion: Conversion
    budget_mode: BudgetMode
    #: evaluate queries the server will send; a silo with private metrics reserves budget
    #: for them (and refuses more once its budget is spent)
    evaluations: int = 0
    #: a smaller epsilon the server asks every silo to calibrate for (the "minimum epsilon"
    #: baseline, docs/aggregation.md); 0: the silo's own budget. A silo takes it only when it
    #: is below its budget: a server can make a silo spend less, never more.
    epsilon_target: float = 0.0
    #: the accountant the server proposes (docs/privacy.md#pld-accounting); a silo measures
    #: its spend with its own (``accountant`` in its node config)
    accountant: AccountantName = DEFAULT_ACCOUNTANT
    #: learning rates each silo chooses among in its first training round (0: the run sets
    #: one): that round trains one model per candidate and selects one privately, so the
    #: plan holds tune_candidates - 1 more rounds of steps and one more selection
    #: (docs/algorithm.md#choosing-the-learning-rate)
    tune_candidates: int = 0

    @property
    def selections(self) -> int:
        """Private selections the run plans: T_sel, and the learning rate's if it is chosen."""
        return self.select_rounds + (1 if self.tune_candidates else 0)

    def to_config(self) -> dict[str, Any]:
        config = {
            "rounds": self.rounds, "local-epochs": self.local_epochs,
            "batch-size": self.batch_size, "first-batch": str(self.first_batch),
            "select-rounds": self.select_rounds, "select-ratio": self.select_ratio,
            "conversion": self.conversion, "budget-mode": self.budget_mode,
            "evaluations": self.evaluations,
        }
        if self.epsilon_target > 0:  # absent otherwise: runs planned before it keep their key
            config["epsilon-target"] = self.epsilon_target
        if self.accountant != UNNAMED_ACCOUNTANT:  # RDP runs keep the key they were planned by
            config["accountant"] = self.accountant
        if self.tune_candidates:  # absent otherwise: runs with a set learning rate keep theirs
            config["tune-candidates"] = self.tune_candidates
        return config

    def key(self) -> str:
        return repr(sorted(self.to_config().items()))
