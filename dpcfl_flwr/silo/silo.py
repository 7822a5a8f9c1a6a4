"""What a silo does with a round, independent of how the round reached it (Flower or a test).

The silo owns its privacy (docs/threat-model.md): its budget, ledger, data split, noise seed
and reporting policy come from its own node config (only in simulation, where one operator
plays every role, from the run config); it calibrates its own noise multiplier for the whole
schedule the server proposes, charges every mechanism to a ledger on its own disk, under an OS
lock, *before* it releases anything, and refuses a round that would take its spent epsilon
over its budget.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..config.settings import ConfigError, ExperimentConfig, SiloConfig
from ..data import ClientData, DataError
from ..data.arrays import check_schema
from ..data.scaling import scaled_inputs
from ..data.schema import Schema
from ..data.sources import SCHEMA_FREE_SOURCES, SourceRequest, load_records
from ..dpsgd.engine_choice import EngineChoice
from ..dpsgd.per_sample import engine_name
from ..dpsgd.training import (
    DPSGDConfig,
    classification_sums,
    configure_threads,
    evaluate,
    round_cost,
    secure_generator,
    train_dp,
)
from ..models import ModelSpec, build, build_for_shapes
from ..privacy.accountants import DEFAULT_ACCOUNTANT, accountant_named
from ..privacy.budget import plan_noise
from ..privacy.history import UNNAMED_ACCOUNTANT, History
from ..privacy.ledger import (
    Entry,
    GaussianSteps,
    PrivacyBudget,
    PrivacyLedger,
    Selection,
    ledger_lock,
)
from ..privacy.metrics import LOSS_BOUND, EvaluationSums, metric_release_cost, noisy_release
from ..privacy.schedule import Schedule, steps_per_round, tuning_phases, two_stage_schedule
from ..privacy.selection import accuracy_sensitivity, select_cluster
from ..runs.heap import give_back_freed_memory
from .limits import refuse_beyond_limits
from .requests import BadRequest
from .schema_pin import pinned_schema, refuse_other_schema

logger = logging.getLogger(__name__)


#: Noise plans a ledger keeps (one per run key, the oldest dropped first). A plan only says
#: which z a run uses; spending is bounded by the ledger's history, so dropping one is safe.
MAX_PLANS = 64


class BudgetExceeded(RuntimeError):
    """The silo refuses a round: running it would spend more than its budget."""


class SiloSettingsError(RuntimeError):
    """The silo's own settings (node config, its schema file) cannot be used. The details name
    its files, so they stay in its log: the server learns only that this silo cannot run."""


class RoundRepeated(RuntimeError):
    """The silo refuses a round of a run that it already ran and charged (the server resumed
    the run after the round's message had reached the silo): a run's round releases the
    silo's records once. Its next rounds are still planned for."""


@dataclass(frozen=True)
class SiloPlan:
    """The silo's commitment for one run: z and eps per selection, and the accountant
    that calibrated z (plans stored before there was a choice: ``rdp``)."""

    noise_multiplier: float
    epsilon_select: float
    schedule_key: str
    accountant: str = UNNAMED_ACCOUNTANT


@functools.lru_cache(maxsize=32)
def _client_data(silo: SiloConfig, schema: Schema | None) -> ClientData:
    """The records of a resolved silo config from its data source (cached: a warm silo
    answers every round), built to ``schema`` (None: before a run's schema is known, for a
    source that needs none: the benchmarks and arrays)."""
    assert silo.test_fraction is not None and silo.data_source  # resolved
    options = silo.model_dump(by_alias=True)
    options["clusters"] = ",".join(map(str, silo.topology.cluster_sizes))
    path = Path(silo.data_path) if silo.data_path else Path(".")
    request = SourceRequest(path, silo.partition_id, int(silo.data_seed or 0),
                            float(silo.val_fraction or 0), silo.test_fraction,
                            schema or _SCHEMA_FREE, options)
    return load_records(silo.data_source, request)


#: What such a source is handed before a run's schema is known: it reads records as stored.
_SCHEMA_FREE = Schema((1,), 2)


def client_records(settings: SiloConfig, schema: Schema | None) -> ClientData:
    """A resolved silo's records, built to ``schema`` (None: not known yet; only a source
    that reads records as stored, the benchmarks and arrays, can do without). The schema is
    not checked here (:func:`~..data.arrays.check_schema`)."""
    if settings.data_source in SCHEMA_FREE_SOURCES:
        return _client_data(settings, None)
    if schema is None:
        raise DataError(f"data-source {settings.data_source} builds records to the "
                        "federation's schema: give it (schema-file in the silo file, or "
                        "--schema)")
    return _client_data(settings, schema)


def records_problem(settings: SiloConfig, schema: Schema | None = None) -> str | None:
    """Why a silo with these resolved settings could not build its train / validation / test
    split (its partition outside its topology, a missing or damaged data file, records that
    do not fit ``schema``), in one line; None: it can. ``dpcfl client`` asks before the silo
    connects, so a silo that would fail every message never joins a run. Without a schema, a
    source that builds records to one (an image folder, a table) is only checked for its
    path."""
    try:
        if settings.data_source == "benchmark":
            settings.topology.cluster_of(settings.partition_id)
        if schema is None and settings.data_source not in SCHEMA_FREE_SOURCES:
            if not Path(settings.data_path).exists():
                raise DataError(f"{settings.data_path}: no such file or directory")
            return None
        data = client_records(settings, schema)
        if schema is not None:
            check_schema(data, schema.input_shape, schema.num_classes,
                         f"records {settings.data_path or settings.dataset}")
        records = data.num_train
    except (DataError, ValueError, OSError) as exc:
        return f"the silo's records: {exc}"
    if settings.batch_size is not None and settings.batch_size > records:
        return (f"the silo's batch-size {settings.batch_size} exceeds its {records} training "
                "records")
    return None


class Silo:
    """One silo in one run: its data, budget, ledger and plan.

    ``trust_run_config`` is for simulation only: settings the node config leaves unset come
    from the run config. Otherwise (deployment) budget, ledger and split are the node
    config's own and a missing budget or ledger stops the silo (:meth:`SiloConfig.resolved`).
    """

    def __init__(self, silo: SiloConfig, experiment: ExperimentConfig, run_id: int,
                 state_ledger: str | None = None, trust_run_config: bool = False,
                 own_process: bool = False) -> None:
        try:
            self.silo = silo.resolved(experiment, trust_run_config)
            #: the schema its records are read under: deployed, its pinned one, and a run
            #: with another is refused before any record is read (:mod:`.schema_pin`)
            self.schema = (experiment.data_schema if trust_run_config
                           else pinned_schema(self.silo))
        except ConfigError as exc:
            raise SiloSettingsError(str(exc)) from None
        if not trust_run_config:
            refuse_other_schema(self.schema, experiment.data_schema)
        refuse_beyond_limits(experiment.model_spec, experiment.physical_batch_size, self.silo)
        # a deployed silo's process is its own: what its accountant freed can go back to the
        # system (:meth:`check`); a simulation's worker serves silo after silo
        self._own_process = own_process
        self.experiment, self.run_id = experiment, run_id
        configure_threads(self.silo.threads)
        assert self.silo.epsilon is not None and self.silo.delta is not None  # resolved
        self.budget = PrivacyBudget(self.silo.epsilon, self.silo.delta, experiment.conversion,
                                    self.silo.accountant or DEFAULT_ACCOUNTANT)
        self.ledger_path = Path(self.silo.ledger_path)
        self._state_ledger = state_ledger
        self.ledger = self._load_ledger()
        self._unstored_plan: tuple[str, SiloPlan] | None = None

    # --- identity and data ----------------------------------------------------------------
    @functools.cached_property
    def data(self) -> ClientData:
        """The silo's records, checked against its schema (DataError naming what differs,
        before anything is trained or charged; its text stays on the silo)."""
        schema = self.schema
        try:
            data = client_records(self.silo, schema)
        except DataError as exc:
            raise DataError(f"silo {self.silo.partition_id}: {exc}") from None
        where = (f"silo {self.silo.partition_id}: records "
                 f"{self.silo.data_path or self.silo.dataset}")
        check_schema(data, schema.input_shape, schema.num_classes, where)
        return scaled_inputs(data, schema, self.silo.data_source or "")

    @property
    def true_cluster(self) -> int:
        """The operator's label of the silo's group (evaluation only): set in its node
        config, else the benchmark topology's; -1 for its own records without a label."""
        if self.silo.true_cluster >= 0 or self.silo.data_source != "benchmark":
            return self.silo.true_cluster
        return self.silo.topology.cluster_of(self.silo.partition_id)

    @property
    def private_metrics(self) -> bool:
        return self.silo.metrics == "private"

    def describe(self) -> dict[str, float | int]:
        """What the silo tells the server about itself (the ``query`` reply)."""
        described: dict[str, float | int] = {
            "partition-id": self.silo.partition_id, "true-cluster": self.true_cluster,
            "num-train": self.data.num_train,
            # what it claims: its real budget, unless it is set to lie (attack experiments)
            "epsilon-budget": self.silo.reported_epsilon or self.budget.epsilon,
            "delta": self.budget.delta, "epsilon-spent": self.spent(),
        }
        if self.silo.batch_size is not None:
            described["batch-size"] = self.silo.batch_size
        return described

    # --- ledger ---------------------------------------------------------------------------
    def _load_ledger(self) -> PrivacyLedger:
        on_disk = PrivacyLedger.load(self.ledger_path)
        state = self._state_ledger
        in_state = PrivacyLedger.from_json(state) if state else PrivacyLedger()
        # Histories only grow: the longer one is the more recent (e.g. a lost file).
        return in_state if len(in_state.entries) > len(on_disk.entries) else on_disk

    @contextlib.contextmanager
    def charging(self) -> Iterator[None]:
        """Hold the ledger's OS lock from the budget check to the durable write of the charge:
        the ledger is read again under the lock (another handler of this silo may have
        charged meanwhile) and saved before the lock is released, whatever happens inside."""
        with ledger_lock(self.ledger_path):
            self.ledger = self._load_ledger()
            try:
                yield
            finally:
                self.persist()

    def persist(self) -> str:
        """Save the ledger to the silo's disk; returns its JSON for Flower's context.state."""
        self.ledger.save(self.ledger_path)
        self._state_ledger = self.ledger.to_json()
        return self._state_ledger

    def charge_seed(self) -> int | None:
        """Tests only (``noise-seed``): a seed that differs for every charge the ledger has
        recorded, so a repeated round never reuses a noise draw; None: OS entropy."""
        if self.silo.noise_seed < 0:
            return None
        sequence = np.random.SeedSequence([self.silo.noise_seed, len(self.ledger.entries)])
        return int(sequence.generate_state(1, dtype=np.uint32)[0])

    def spent(self) -> float:
        return self.ledger.spent(self.budget)

    def run_name(self, run_key: int) -> str:
        """What the ledger files a run under: the server's run key (the same when it resumes
        the run in a new Flower run), else this Flower run's id."""
        return str(run_key or self.run_id)

    def refuse_repeat(self, run_key: int, kind: str, round_number: int) -> None:
        """RoundRepeated if this run (``run_key``; 0: this Flower run) already had its round
        ``round_number`` of ``kind`` ("train", "evaluate") charged. Under the whole-budget
        default a repeat would not fit, and charging it would only refuse the silo's later
        rounds, which its plan still covers."""
        done = self.ledger.meta.get("rounds", {}).get(self.run_name(run_key), {})
        if round_number in done.get(kind, ()):
            raise RoundRepeated(
                f"silo {self.silo.partition_id} already ran and charged {kind} round "
                f"{round_number} of this run (the server resumed the run after that round "
                "reached the silo): it does not release its records for that round again, "
                "and takes part from the next round")

    def note_charged(self, run_key: int, kind: str, round_number: int) -> None:
        """Record that the run's round ``round_number`` of ``kind`` was charged (saved with
        the charge; the rounds of at most :data:`MAX_PLANS` runs are kept)."""
        rounds = self.ledger.meta.setdefault("rounds", {})
        done = rounds.setdefault(self.run_name(run_key), {})
        done[kind] = sorted({*done.get(kind, ()), round_number})
        for old in list(rounds)[:max(0, len(rounds) - MAX_PLANS)]:
            del rounds[old]

    # --- plan -------------------------------------------------------------------------------
    def plan(self, schedule: Schedule, run_key: int = 0, trains: bool = True) -> SiloPlan:
        """Calibrate z for the proposed schedule once per run; the plan is kept in the ledger
        with the run's first charge (:meth:`charge`), so a message refused later leaves no
        trace in the ledger.

        ``run_key``: what the server names the run by, the same when it resumes the run in a
        new Flower run (0: this Flower run's id), so a resumed silo keeps its z. A key only
        picks which stored plan applies; what the silo may spend is its ledger's to say.
        ``trains=False``: a run without DP-SGD (the majority baseline), whose plan is only
        its selection's epsilon (:meth:`_selection_plan`), z = 0."""
        key = self.run_name(run_key)
        stored = self.ledger.meta.get("runs", {}).get(key)
        if stored is not None:
            if stored["schedule_key"] != schedule.key() or (
                    stored["noise_multiplier"] > 0) != trains:
                raise BudgetExceeded("the server changed the DP schedule in the middle of a run")
            return SiloPlan(**stored)
        spent_before = self.spent()
        plan = (self._calibrate(schedule, spent_before) if trains
                else self._selection_plan(schedule, spent_before))
        self._unstored_plan = (key, plan)
        if spent_before > 0:
            logger.warning("silo %s starts run %s with epsilon %.4g of %g already spent in "
                           "earlier runs: z=%.4f for what is left (%s)", self.silo.partition_id,
                           self.run_id, spent_before, self.budget.epsilon,
                           plan.noise_multiplier, schedule)
        elif not trains:
            logger.info("silo %s: no DP-SGD in this run, a selection costs eps_select=%.4g",
                        self.silo.partition_id, plan.epsilon_select)
        else:
            logger.info("silo %s: z=%.4f for %s", self.silo.partition_id,
                        plan.noise_multiplier, schedule)
        return plan

    def charge(self, entries: Sequence[Entry]) -> None:
        """Record mechanisms in the ledger, with the run's plan if this is its first charge
        (at most :data:`MAX_PLANS` plans are kept, the oldest dropped first)."""
        if self._unstored_plan is not None:
            key, plan = self._unstored_plan
            runs = self.ledger.meta.setdefault("runs", {})
            runs[key] = plan.__dict__
            for old in list(runs)[:max(0, len(runs) - MAX_PLANS)]:
                del runs[old]
            self._unstored_plan = None
        self.ledger.record(entries)

    def _calibrate(self, s: Schedule, spent_before: float) -> SiloPlan:
        """z for the schedule under the silo's own accountant, composed with the ledger's
        history (earlier runs, which spent ``spent_before``: measured once by the caller, a
        PLD composition of the whole history) and the run's private evaluations; selections
        take their share of the budget as the budget mode says
        (docs/privacy.md#calibrating-z)."""
        n, b = self.data.num_train, self.budget
        phases = (two_stage_schedule(n, s.batch_size, s.local_epochs, s.rounds, s.first_batch)
                  + tuning_phases(n, s.batch_size, s.local_epochs, s.tune_candidates))
        history = self.ledger.history(self._reserved_metrics(s))
        target = self._run_target(spent_before, s.epsilon_target)
        try:
            if not self.ledger.entries:
                plan = plan_noise(phases, target, b.delta, s.selections, s.select_ratio,
                                  s.conversion, s.budget_mode, history=history,
                                  accountant=b.accountant)
                return SiloPlan(plan.noise_multiplier, plan.split.epsilon_select, s.key(),
                                b.accountant)
            # Earlier runs already spent part of the budget: fit this run into what is left,
            # its selections taking their share of what this run may spend.
            eps_select = s.select_ratio * max(target - spent_before, 0.0)
            history = history + History.of_selections(eps_select, s.selections)
            z = accountant_named(b.accountant).calibrate(phases, target, b.delta,
                                                         s.conversion, history)
        except ValueError as exc:
            if spent_before > 0:  # the usual case: earlier runs spent (about) all of it
                raise BudgetExceeded(
                    f"no noise level fits the remaining budget: earlier runs spent epsilon "
                    f"{spent_before:.4g} of {b.epsilon:g}, this run may end at {target:.4g} "
                    "(a silo meant for several runs sets run-epsilon, "
                    "docs/privacy.md#runs-after-the-first)") from None
            raise BudgetExceeded(f"no noise level fits the remaining budget: {exc}") from None
        return SiloPlan(z, eps_select, s.key(), b.accountant)

    def _selection_plan(self, s: Schedule, spent_before: float) -> SiloPlan:
        """The plan of a run that only selects (the majority baseline, no DP-SGD): each
        selection at eps_select = ``select-ratio`` x what this run may spend (the same share
        a training run's selections take, docs/privacy.md#budget-split-and-joint-mode); no
        z to calibrate. BudgetExceeded when nothing is left to spend."""
        eps_select = s.select_ratio * max(
            self._run_target(spent_before, s.epsilon_target) - spent_before, 0.0)
        if not eps_select > 0:
            raise BudgetExceeded(
                f"no selection fits the remaining budget: earlier runs spent epsilon "
                f"{spent_before:.4g} of {self.budget.epsilon:g}")
        return SiloPlan(0.0, eps_select, s.key(), self.budget.accountant)

    def _run_target(self, spent_before: float, server_target: float) -> float:
        """The epsilon (earlier runs' spend included) a new run is calibrated to end at: the
        budget; less with the silo's ``run-epsilon`` (earlier spend plus that); less when the
        server asks for less (``server_target`` > 0: the minimum-epsilon baseline), never
        more."""
        target = self.budget.epsilon
        if self.silo.run_epsilon is not None:
            target = min(target, spent_before + self.silo.run_epsilon)
        return min(target, server_target) if server_target > 0 else target

    def _reserved_metrics(self, s: Schedule) -> list[GaussianSteps]:
        """The run's private evaluations, as one ledger entry (none with exact metrics)."""
        if not self.private_metrics or not s.evaluations:
            return []
        assert self.silo.metrics_noise is not None  # resolved
        return [replace(metric_release_cost(self.silo.metrics_noise, None), steps=s.evaluations)]

    def own_schedule(self, proposed: Schedule) -> Schedule:
        """The schedule the silo runs: the server's, with the silo's own batch size b_i
        (node config ``batch-size``) in place of the proposed b wherever it is set."""
        own = self.silo.batch_size
        if own is None:
            return proposed
        first = own if proposed.first_batch == proposed.batch_size else proposed.first_batch
        return replace(proposed, batch_size=own, first_batch=first)

    def own_batch(self, proposed: int | Literal["full"], schedule: Schedule
                  ) -> int | Literal["full"]:
        """The round's expected batch: the silo's own b_i where the server proposed its
        schedule's b, else what it proposed (the full batch, R-DPCFL's round 1)."""
        own = self.silo.batch_size
        return own if own is not None and proposed == schedule.batch_size else proposed

    # --- rounds -----------------------------------------------------------------------------
    def check(self, planned: list[GaussianSteps | Selection], round_number: int) -> None:
        """BudgetExceeded when the round's ``planned`` mechanisms would take the ledger past
        the budget. This ends the accountant's work before a round trains or tests: what its
        compositions freed (tens of MB on the 1e-4-nat grid) goes back to the system first,
        so the round's peak is the larger of the two, not their sum (runs/heap.py); in a
        process of its own only (``own_process``), as after each message."""
        try:
            self._check(planned, round_number)
        finally:
            if self._own_process:
                give_back_freed_memory()

    def _check(self, planned: list[GaussianSteps | Selection], round_number: int) -> None:
        if self.ledger.would_exceed(planned, self.budget):
            after = self.ledger.epsilon(self.budget.delta, self.budget.conversion, planned,
                                        self.budget.accountant)
            raise BudgetExceeded(
                f"silo {self.silo.partition_id} refuses round {round_number}: it would spend "
                f"eps={after:.4f} > budget {self.budget.epsilon:g} (spent so far "
                f"{self.spent():.4f}, delta={self.budget.delta:g})"
            )

    def new_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The run's model, built from this silo's own installed code (the registry), with
        ``state`` loaded; ConfigError when it cannot be built here."""
        model = build(self.experiment.model_spec)
        model.load_state_dict(state)
        return model

    def template(self) -> dict[str, torch.Tensor]:
        """The model's tensor names and shapes, to unpack the one-Array models messages carry."""
        return _template(self.experiment.model_spec)

    def _channels(self) -> int:
        return self.experiment.record_shape[0]

    def select(self, candidates: list[dict[str, torch.Tensor]], plan: SiloPlan,
               round_number: int) -> int:
        """Private cluster selection: exponential mechanism on train accuracy
        (docs/algorithm.md#stage-3-private-cluster-selection, A10)."""
        utilities = [
            100.0 * evaluate(self.new_model(s), self.data.x_train, self.data.y_train)[1]
            for s in candidates
        ]
        seed = self.charge_seed()
        rng = None if seed is None else np.random.default_rng(seed)
        choice = select_cluster(utilities, plan.epsilon_select,
                                accuracy_sensitivity(self.data.num_train), rng)
        self.charge([Selection(plan.epsilon_select, round=round_number)])
        return choice

    def check_work(self, schedule: Schedule, batch: int | Literal["full"]) -> None:
        """Refuse a round or a schedule whose rounds would run more DP-SGD steps than the
        silo's limit (node config ``max-round-steps``), or a batch above its records: the
        work one message can cause is bounded before anything is computed."""
        n, limit = self.data.num_train, self.silo.max_round_steps
        asked = [("round-batch", batch), ("batch-size", schedule.batch_size),
                 ("first-batch", schedule.first_batch)]
        for field, size in asked:
            if size != "full" and size > n:
                raise BadRequest(f"train message: '{field}' = {size} exceeds this silo's {n} "
                                 "training records")
            steps = int(steps_per_round(n, n if size == "full" else size,
                                        schedule.local_epochs))
            if steps > limit:
                raise BadRequest(
                    f"train message: 'local-epochs' = {schedule.local_epochs} with "
                    f"'{field}' = {size} asks {steps} DP-SGD steps a round of this silo's {n} "
                    f"records; it runs at most {limit} (node config 'max-round-steps')")

    def round_cost(self, plan: SiloPlan, batch: int | Literal["full"], round_number: int,
                   epochs: int) -> GaussianSteps:
        return round_cost(self.data.num_train, batch, epochs, plan.noise_multiplier,
                          round_number)

    def train(self, state: dict[str, torch.Tensor], config: DPSGDConfig, round_number: int,
              prox: tuple[float, dict[str, torch.Tensor]] | None = None) -> tuple[
                  dict[str, torch.Tensor], dict[str, float]]:
        """One round of DP-SGD from ``state``; charges the ledger and returns the update with
        the numbers the silo reports (validation figures only with exact metrics)."""
        model = self.new_model(state)
        result = train_dp(model, self.data.x_train, self.data.y_train, config,
                          round_number=round_number, seed=self.charge_seed(), prox=prox)
        self._log_engine(model, result.engine)
        self.charge(result.entries)
        metrics: dict[str, float] = {"num-examples": self.data.num_train}
        if not self.private_metrics and len(self.data.y_val):  # a given split may have none
            metrics["val-loss"], metrics["val-accuracy"] = evaluate(
                model, self.data.x_val, self.data.y_val)
        return result.update, metrics

    def _log_engine(self, model: torch.nn.Module, choice: EngineChoice | None) -> None:
        """Say once per silo and run which per-sample engine DP-SGD used for the model, and
        why (no record drawn in any step: nothing to say yet)."""
        key = (self.silo.partition_id, self.run_id)
        if choice is not None and key not in _ENGINES_LOGGED:
            _ENGINES_LOGGED.add(key)
            logger.info("silo %s: model %s trains with the %s engine: %s",
                        self.silo.partition_id, self.experiment.model,
                        engine_name(model, choice.mode), choice.reason)

    def evaluation_cost(self, round_number: int) -> list[GaussianSteps]:
        """What answering an evaluate query costs: nothing with exact metrics."""
        if not self.private_metrics:
            return []
        assert self.silo.metrics_noise is not None  # resolved
        return [metric_release_cost(self.silo.metrics_noise, round_number)]

    def test(self, model: torch.nn.Module, round_number: int
             ) -> tuple[EvaluationSums, EvaluationSums]:
        """The sums of ``model`` on the test split (docs/privacy.md#private-evaluation-metrics):
        (what the silo reports, what it knows). The report is exact, or (private metrics)
        the Gaussian mechanism's release, charged; call inside :meth:`charging` after
        :meth:`check`. What it knows is exact and stays in the silo (its model file,
        :mod:`.kept_model`); with private metrics its losses are clipped to ``LOSS_BOUND``."""
        x, y, classes = self.data.x_test, self.data.y_test, self.experiment.num_classes
        if not self.private_metrics:
            exact = classification_sums(model, x, y, classes)
            return exact, exact
        exact = classification_sums(model, x, y, classes, LOSS_BOUND)
        cost = self.evaluation_cost(round_number)
        generator = secure_generator(self.charge_seed())
        self.charge(cost)
        return noisy_release(exact, cost[0].noise_multiplier, generator), exact


#: (partition, run) pairs whose engine this process has logged.
_ENGINES_LOGGED: set[tuple[int, int]] = set()


@functools.lru_cache(maxsize=4)
def _template(spec: ModelSpec) -> dict[str, torch.Tensor]:
    # Built once per process (a warm runtime answers every round of its silo) on the meta
    # device: names, shapes and dtypes without memory for the weights
    return {k: v.detach().to("meta") for k, v in build_for_shapes(spec).state_dict().items()}
