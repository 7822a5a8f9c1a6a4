"""The method interface: what a federated method decides, and nothing of Flower.

A method answers four questions (docs/adding-a-method.md):

- which cluster model each silo trains in a round (:meth:`Method.assign`; also the round's
  stage, batch and DP schedule),
- what the server learns from the round's replies (:meth:`Method.absorb`),
- which model a silo keeps, the one it is evaluated on (:meth:`Method.current_cluster`),
- what a silo does differently in training, if anything (:attr:`Method.personal`: it keeps
  its own model; :meth:`Method.silo_settings`: extra fields of its train message, which the
  silo validates like every other field; :meth:`Method.extra_models`).

The strategy (:class:`dpcfl_flwr.strategies.ClusteredStrategy`) turns those decisions into
Flower messages and folds the replies back; a method reads and changes only the
:class:`ServerState` it is given. Its own parameters are a typed table
(:class:`MethodParams`), written ``[<name>]`` in a config file and ``<name>.<key>`` in the
flat run config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field

from ..aggregation import RuleSettings, UpdateFacts, cluster_means
from ..config.validation import ConfigModel
from ..privacy.schedule import Schedule
from ..protocol import WireModel

if TYPE_CHECKING:
    from ..config.settings import ExperimentConfig

#: Assignment of a round whose silos train theta_init and belong to no cluster yet (R-DPCFL's
#: round 1, k-means' first round, Local's first round).
INITIAL = -2


class MethodParams(ConfigModel):
    """A method's own parameters; subclasses declare fields with defaults and bounds. Keys
    are kebab-case in config files (``n-clusters``), like every run-config key."""


class SelectionParams(MethodParams):
    """Private cluster selection (docs/algorithm.md#stage-3-private-cluster-selection): each
    silo picks one of the M models with the exponential mechanism on its train accuracy."""

    selection: Literal["window", "every-round"] = "window"
    select_window: float = Field(0.1, gt=0.0, le=1.0, description="share of E, for T_sel")
    select_ratio: float = Field(0.03, gt=0.0, lt=1.0, description="share of eps per selection")

    def select_rounds(self, rounds: int) -> int:
        """T_sel: private selections a silo reserves budget for, of ``rounds`` rounds."""
        if self.selection == "every-round":
            return rounds
        return max(1, int(self.select_window * rounds))


@dataclass
class SiloInfo:
    """What the server knows about a silo (from its query reply and its rounds). Epsilons are
    in the silo's (epsilon, delta)-DP units; ``num_train`` counts training records."""

    partition: int
    node_id: int
    true_cluster: int
    num_train: int
    epsilon_budget: float
    delta: float
    epsilon_spent: float = 0.0
    exhausted: bool = False
    dropped_rounds: list[int] = field(default_factory=list)
    refused_rounds: list[int] = field(default_factory=list)
    test_accuracy: float | None = None
    test_loss: float | None = None
    #: from its last evaluation's per-class sums; AUROC for two classes only
    test_balanced_accuracy: float | None = None
    test_auroc: float | None = None
    #: the class it predicts for every record (the majority baseline), as it reported it
    majority_class: int | None = None
    noise_multiplier: float | None = None
    #: expected batch size (records) of its last round, as it reported it
    batch_size: int | None = None
    #: its weight in its cluster's last aggregation (docs/aggregation.md)
    weight: float | None = None
    #: d-privacy silos: the leakage (sum of n/v) its ledger holds, as it reported it
    dprivacy_leakage: float | None = None
    #: Epsilon its ledger held when it joined this run (earlier runs' spend): the budget this
    #: run can use is what is left, so its noise is larger than a fresh silo's.
    epsilon_spent_before: float = 0.0
    #: the learning rate it chose privately among the run's candidates, as it reported it
    #: (docs/algorithm.md#choosing-the-learning-rate); None before it chose, or when the
    #: run sets one
    learning_rate: float | None = None


@dataclass
class TrainReply:
    """A silo's checked train reply: the cluster it trained (or INITIAL / OWN), its update
    (a flat float32 vector, read-only: it may be a view of the message's bytes; None when the
    silo keeps its model) and its other numbers."""

    cluster: int
    update: np.ndarray | None
    metrics: dict[str, Any]
    #: per-coordinate variance of the DP noise in the update at learning rate 1, from the z,
    #: batch size and steps the silo reports (None when it reports none): evaluation only
    #: (the oracle rule, the noise-level figures); nothing private depends on it
    noise_variance: float | None = None


@dataclass
class ServerState:
    """What the server holds for a run, shared by the strategy and its method.

    ``initial``: theta_init as a flat float32 vector. ``models``: the cluster models, same
    layout; their count is M (a method may resize the list, e.g. after clustering).
    ``silos``: what the server knows of each silo, by partition id."""

    initial: np.ndarray
    models: list[np.ndarray] = field(default_factory=list)
    silos: dict[int, SiloInfo] = field(default_factory=dict)
    #: the last round's aggregation of each cluster it moved: weights, noise levels, fallback
    aggregation: dict[int, dict[str, Any]] = field(default_factory=dict)

    def reset_models(self, count: int) -> None:
        """``count`` cluster models, each theta_init."""
        self.models = [self.initial.copy() for _ in range(count)]


class Method(ABC):
    """A federated method's server-side decisions (see the module docstring).

    Subclasses set :attr:`name` (and register with :func:`dpcfl_flwr.config.registry.register`),
    :attr:`Params` when they have parameters, and implement :meth:`assign` and
    :meth:`current_cluster`; :meth:`initial_clusters` sizes the server's models."""

    #: The run-config value ``method = <name>`` and the name of its parameter table.
    name: ClassVar[str]
    #: One line for listings (``dpcfl compare``, docs).
    title: ClassVar[str] = ""
    Params: ClassVar[type[MethodParams]] = MethodParams
    #: Silos keep their trained model and send no update (Local).
    personal: ClassVar[bool] = False
    #: The method learns the cluster structure (results say whether it found it).
    discovers_clusters: ClassVar[bool] = False
    #: Its cluster models move by :meth:`absorb`'s weighted means, so the run config's
    #: ``aggregation`` rule applies (False: the method combines updates its own way).
    weighs_updates: ClassVar[bool] = True
    #: How its silos privatise what they release: DP-SGD ((epsilon, delta)-DP per record), or
    #: d-privacy's sanitised models (methods/dprivacy.py). A silo refuses a run whose
    #: privatiser is not its own (docs/threat-model.md).
    privatiser: ClassVar[str] = "dpsgd"

    def __init__(self, experiment: ExperimentConfig, params: BaseModel,
                 state: ServerState) -> None:
        """``params``: an instance of :attr:`Params` (the run's table for this method);
        ``state``: the server's models and silos, which the method reads and changes."""
        self.experiment = experiment
        self.params = params
        self.state = state
        state.reset_models(self.initial_clusters())

    @classmethod
    def silo_defaults(cls, params: BaseModel) -> dict[str, Any]:
        """Simulation only: the node-config settings (SiloConfig fields) a silo takes from
        this method's table when its own node config leaves them unset."""
        return {}

    def initial_clusters(self) -> int:
        """M at the start of the run, each model theta_init: the table's ``n-clusters`` when
        it has one, else none (silos keep their models, or the method adds them)."""
        return int(getattr(self.params, "n_clusters", 0))

    @property
    def n_clusters(self) -> int:
        return len(self.state.models)

    # --- the round's plan -----------------------------------------------------------------
    def schedule(self) -> Schedule:
        """The DP schedule every silo calibrates its noise for: by default single-stage
        DP-SGD at batch b for E rounds, no selection."""
        e = self.experiment
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size, e.batch_size, 0,
                        0.0, e.conversion, e.budget_mode)

    def stage(self, server_round: int) -> str:
        """A name for the round's phase (logs, results)."""
        return "train"

    def chooses_learning_rate(self) -> bool:
        """Whether silos choose their learning rate privately when the run sets none
        (docs/algorithm.md#choosing-the-learning-rate): DP-SGD methods do."""
        return True

    def tuning_round(self) -> int:
        """The first round in which a silo may choose its learning rate: its first round of
        regular training."""
        return 1

    def round_batch(self, server_round: int) -> int | Literal["full"]:
        """Expected batch size of the round's DP-SGD steps, or "full" (rate 1)."""
        return self.experiment.batch_size

    @abstractmethod
    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        """The cluster each listed silo trains this round: an index 0..M-1, SELECT (choose
        privately among all M), INITIAL (theta_init) or OWN (its own model)."""

    def extra_models(self, server_round: int) -> dict[str, WireModel]:
        """Models every train message of the round carries besides its cluster's (MR-MTL's
        anchor), by record key."""
        return {}

    def silo_settings(self, server_round: int, cluster: int) -> dict[str, Any]:
        """Extra fields of a train message (defined in docs/protocol.md and validated by the
        silo): what silos do differently in training for this method."""
        return {}

    # --- learning from the replies ------------------------------------------------------------
    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        """Learn from the round's checked replies (by partition); by default each cluster
        model moves by its trainers' updates, weighted by the run's aggregation rule
        (docs/aggregation.md)."""
        contributions = {p: (r.cluster, r.update) for p, r in replies.items()
                         if r.update is not None}
        e = self.experiment
        self.state.models, combined = cluster_means(
            self.state.models, contributions,
            {p: self.update_facts(p, replies[p]) for p in contributions}, e.aggregation,
            RuleSettings(rpca_rows=e.rpca_rows, rpca_min_silos=e.rpca_min_silos, seed=e.seed))
        self.state.aggregation = {m: c.to_dict() for m, c in combined.items()}
        for aggregation in combined.values():
            for partition, weight in aggregation.weights.items():
                self.state.silos[partition].weight = weight

    def update_facts(self, partition: int, reply: TrainReply) -> UpdateFacts:
        """What the aggregation rule may know of silo ``partition``'s update: its record
        count and the budget it claims, as it told the server, and the reported noise."""
        silo = self.state.silos[partition]
        return UpdateFacts(partition, silo.num_train, silo.epsilon_budget, reply.noise_variance)

    @abstractmethod
    def current_cluster(self, partition: int) -> int:
        """The cluster model silo ``partition`` uses now (what it is evaluated on)."""

    # --- the run ----------------------------------------------------------------------------
    def silos_needed(self) -> int:
        """The fewest silos this run of the method can run with."""
        return self.fewest_silos(self.params)

    @classmethod
    def fewest_silos(cls, params: BaseModel) -> int:
        """The fewest silos the method can run with under its parameter table ``params``:
        a run config whose topology has fewer is refused before anything starts."""
        return 1

    def results(self) -> dict[str, Any]:
        """What the method learnt, for results.json's ``clustering`` block (JSON values)."""
        return {}

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The method's own state after a round (assignments, clustering, choices), for the
        run's checkpoint: by default every attribute a subclass added. The models and silos
        are the strategy's (:class:`ServerState`) and saved with it."""
        return {key: value for key, value in vars(self).items()
                if key not in ("experiment", "params", "state")}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``saved`` (a resumed run)."""
        vars(self).update(saved)
