"""What a silo does with a round, independent of how the round reached it (Flower or a test).

The silo owns its privacy: it reads its budget from its own node config, calibrates its own
noise multiplier for the whole schedule the server proposes, charges every mechanism to a
ledger on its own disk *before* it releases anything, and refuses a round that would take its
spent epsilon over its budget (ARCHITECTURE: the server is not trusted with privacy).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .config import ExperimentConfig, SiloConfig
from .data import ClientData, load_dataset, make_client_data
from .models import build_model
from .privacy import (
    GaussianSteps,
    PrivacyBudget,
    PrivacyLedger,
    Selection,
    accuracy_sensitivity,
    calibrate_noise_multiplier,
    plan_noise,
    select_cluster,
    selection_rdp,
    two_stage_schedule,
)
from .training import DPSGDConfig, configure_threads, evaluate, round_cost, train_dp

logger = logging.getLogger(__name__)


class BudgetExceeded(RuntimeError):
    """The silo refuses a round: running it would spend more than its budget."""


@dataclass(frozen=True)
class Schedule:
    """The whole DP-SGD schedule the server proposes; the silo calibrates z for it once."""

    rounds: int
    local_epochs: int
    batch_size: int
    first_batch: int | Literal["full"]
    select_rounds: int
    select_ratio: float
    conversion: Literal["classic", "tight"]
    budget_mode: Literal["split", "joint"]

    def to_config(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds, "local-epochs": self.local_epochs,
            "batch-size": self.batch_size, "first-batch": str(self.first_batch),
            "select-rounds": self.select_rounds, "select-ratio": self.select_ratio,
            "conversion": self.conversion, "budget-mode": self.budget_mode,
        }

    @classmethod
    def from_config(cls, config: Any) -> Schedule:
        first = str(config["first-batch"])
        return cls(
            int(config["rounds"]), int(config["local-epochs"]), int(config["batch-size"]),
            "full" if first == "full" else int(first), int(config["select-rounds"]),
            float(config["select-ratio"]), config["conversion"], config["budget-mode"],
        )

    def key(self) -> str:
        return repr(sorted(self.to_config().items()))


@dataclass(frozen=True)
class SiloPlan:
    """The silo's commitment for one run: z and eps per selection."""

    noise_multiplier: float
    epsilon_select: float
    schedule_key: str


@functools.lru_cache(maxsize=32)
def _client_data(dataset: str, data_dir: str, clusters: str, shift: str, samples: int,
                 seed: int, val_fraction: float, test_samples: int, draw: str,
                 partition: int) -> ClientData:
    from .data import Topology

    train, test = load_dataset(dataset, data_dir or None)
    return make_client_data(train, test, partition, Topology.parse(clusters), shift, samples,
                            seed=seed, val_fraction=val_fraction,
                            test_samples=test_samples or None, dataset=dataset, draw=draw)


class Silo:
    """One silo in one run: its data, budget, ledger and plan."""

    def __init__(self, silo: SiloConfig, experiment: ExperimentConfig, run_id: int,
                 state_ledger: str | None = None) -> None:
        self.silo, self.experiment, self.run_id = silo, experiment, run_id
        configure_threads(silo.threads or experiment.threads)
        self.budget = PrivacyBudget(silo.epsilon or experiment.epsilon,
                                    silo.delta or experiment.delta, experiment.conversion)
        self.ledger_path = Path(silo.ledger_path) if silo.ledger_path else (
            experiment.ledger_directory() / f"silo-{silo.partition_id}.json")
        self.ledger = self._load_ledger(state_ledger)

    # --- identity and data ----------------------------------------------------------------
    @functools.cached_property
    def data(self) -> ClientData:
        e = self.experiment
        return _client_data(e.dataset, self.silo.data_dir or e.data_dir, e.clusters, e.shift,
                            e.samples_per_client, e.seed, e.val_fraction, e.test_samples,
                            e.data_draw, self.silo.partition_id)

    @property
    def true_cluster(self) -> int:
        if self.silo.true_cluster >= 0:
            return self.silo.true_cluster
        return self.experiment.topology.cluster_of(self.silo.partition_id)

    def describe(self) -> dict[str, float | int]:
        """What the silo tells the server about itself (the ``query`` reply)."""
        return {
            "partition-id": self.silo.partition_id, "true-cluster": self.true_cluster,
            "num-train": self.data.num_train, "epsilon-budget": self.budget.epsilon,
            "delta": self.budget.delta, "epsilon-spent": self.spent(),
        }

    # --- ledger -----------------------------------------------------------------------------
    def _load_ledger(self, state_ledger: str | None) -> PrivacyLedger:
        on_disk = PrivacyLedger.load(self.ledger_path)
        in_state = PrivacyLedger.from_json(state_ledger) if state_ledger else PrivacyLedger()
        # Histories only grow: the longer one is the more recent (e.g. a lost file).
        return in_state if len(in_state.entries) > len(on_disk.entries) else on_disk

    def persist(self) -> str:
        """Save the ledger to the silo's disk; returns its JSON for Flower's context.state."""
        self.ledger.save(self.ledger_path)
        return self.ledger.to_json()

    def spent(self) -> float:
        return self.ledger.spent(self.budget)

    # --- plan -------------------------------------------------------------------------------
    def plan(self, schedule: Schedule) -> SiloPlan:
        """Calibrate z for the proposed schedule once per run, and keep it in the ledger."""
        runs = self.ledger.meta.setdefault("runs", {})
        stored = runs.get(str(self.run_id))
        if stored is not None:
            if stored["schedule_key"] != schedule.key():
                raise BudgetExceeded("the server changed the DP schedule in the middle of a run")
            return SiloPlan(**stored)
        plan = self._calibrate(schedule)
        runs[str(self.run_id)] = plan.__dict__
        logger.info("silo %s: z=%.4f for %s", self.silo.partition_id, plan.noise_multiplier,
                    schedule)
        return plan

    def _calibrate(self, s: Schedule) -> SiloPlan:
        n, b = self.data.num_train, self.budget
        phases = two_stage_schedule(n, s.batch_size, s.local_epochs, s.rounds, s.first_batch)
        try:
            if not self.ledger.entries:
                plan = plan_noise(phases, b.epsilon, b.delta, s.select_rounds, s.select_ratio,
                                  s.conversion, s.budget_mode)
                return SiloPlan(plan.noise_multiplier, plan.split.epsilon_select, s.key())
            # Earlier runs already spent part of the budget: fit this run into what is left.
            eps_select = s.select_ratio * b.epsilon
            extra = self.ledger.rdp() + s.select_rounds * selection_rdp(eps_select)
            z = calibrate_noise_multiplier(phases, b.epsilon, b.delta, s.conversion, extra)
        except ValueError as exc:
            raise BudgetExceeded(f"no noise level fits the remaining budget: {exc}") from None
        return SiloPlan(z, eps_select, s.key())

    # --- rounds -----------------------------------------------------------------------------
    def check(self, planned: list[GaussianSteps | Selection], round_number: int) -> None:
        if self.ledger.would_exceed(planned, self.budget):
            after = self.ledger.epsilon(self.budget.delta, self.budget.conversion, planned)
            raise BudgetExceeded(
                f"silo {self.silo.partition_id} refuses round {round_number}: it would spend "
                f"eps={after:.4f} > budget {self.budget.epsilon:g} (spent so far "
                f"{self.spent():.4f}, delta={self.budget.delta:g})"
            )

    def new_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = build_model(self.experiment.model, in_channels=self._channels())
        model.load_state_dict(state)
        return model

    def template(self) -> dict[str, torch.Tensor]:
        """The model's tensor names and shapes, to unpack the one-Array models messages carry."""
        return _template(self.experiment.model, self._channels())

    def _channels(self) -> int:
        return 3 if self.experiment.dataset == "cifar10" else 1

    def select(self, candidates: list[dict[str, torch.Tensor]], plan: SiloPlan,
               round_number: int) -> int:
        """Private cluster selection: exponential mechanism on train accuracy (spec §2.8)."""
        utilities = [
            100.0 * evaluate(self.new_model(s), self.data.x_train, self.data.y_train)[1]
            for s in candidates
        ]
        rng = None if self.silo.noise_seed < 0 else np.random.default_rng(
            [self.silo.noise_seed, round_number])
        choice = select_cluster(utilities, plan.epsilon_select,
                                accuracy_sensitivity(self.data.num_train), rng)
        self.ledger.record([Selection(plan.epsilon_select, round=round_number)])
        return choice

    def round_cost(self, plan: SiloPlan, batch: int | Literal["full"], round_number: int,
                   epochs: int) -> GaussianSteps:
        return round_cost(self.data.num_train, batch, epochs, plan.noise_multiplier,
                          round_number)

    def train(self, state: dict[str, torch.Tensor], config: DPSGDConfig, round_number: int,
              prox: tuple[float, dict[str, torch.Tensor]] | None = None) -> tuple[
                  dict[str, torch.Tensor], dict[str, float]]:
        """One round of DP-SGD from ``state``; charges the ledger and returns the update."""
        model = self.new_model(state)
        seed = None if self.silo.noise_seed < 0 else self.silo.noise_seed * 100_003 + round_number
        result = train_dp(model, self.data.x_train, self.data.y_train, config,
                          round_number=round_number, seed=seed, prox=prox)
        self.ledger.record(result.entries)
        val_loss, val_accuracy = evaluate(model, self.data.x_val, self.data.y_val)
        return result.update, {"num-examples": result.num_examples, "val-loss": val_loss,
                               "val-accuracy": val_accuracy}

    def test(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        loss, accuracy = evaluate(self.new_model(state), self.data.x_test, self.data.y_test)
        return {"num-examples": int(self.data.x_test.shape[0]), "test-loss": loss,
                "test-accuracy": accuracy}


@functools.lru_cache(maxsize=4)
def _template(model: str, channels: int) -> dict[str, torch.Tensor]:
    # Built once per process (a warm runtime answers every round of its silo); meta tensors
    # keep names, shapes and dtypes without holding a second copy of the weights.
    return {k: v.detach().to("meta")
            for k, v in build_model(model, in_channels=channels).state_dict().items()}
