"""R-DPCFL (Algorithm 1 of the TMLR 2025 paper): cluster by gradients, then by losses.

docs/algorithm.md states it stage by stage, with the equations the code cites (A1-A11).

Round 1: every silo takes one full-batch DP step from theta_init; the server clusters the
updates (PCA -> spherical GMM; or, with ``clustering = "noise-aware"``, a mixture that knows
each silo's own noise level), records MSS/MPO and sets E_c = floor((1 - MPO) E / 2).
Rounds 2..E_c: each silo trains the model of a cluster drawn from its soft assignment pi_i.
Rounds > E_c: silos receive all M models and choose one privately (exponential mechanism on
train accuracy); with the ``window`` option (the authors' runs) they choose for T_sel rounds,
E_c+1..E_c+T_sel, and keep their last choice afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from ..clustering import (
    NoiseAwareClusterer,
    StackedRows,
    UpdateClusterer,
    load_mixture_code,
    switch_round,
)
from ..clustering.model_order import ModelOrder, fit_model_order
from ..config.registry import register
from ..config.settings import ExperimentConfig
from ..privacy.schedule import Schedule
from ..protocol import SELECT
from .base import INITIAL, Method, SelectionParams, ServerState, TrainReply

logger = logging.getLogger(__name__)


class RDPCFLParams(SelectionParams):
    """``[rdpcfl]``: R-DPCFL's own parameters (docs/algorithm.md#hyper-parameters-and-defaults)."""

    n_clusters: int = Field(0, ge=0, description="M; 0: chosen from round 1 (m-choice)")
    max_clusters: int = Field(10, ge=2, description="largest M tried when n-clusters = 0")
    m_choice: Literal["null", "max-mss"] = Field(
        "null", description="with n-clusters = 0: each candidate M against a null of no "
        "structure, M = 1 when none stands out (docs/algorithm.md#choice-of-m); or the "
        "authors' largest MSS, which over-splits")
    pca_components: int = Field(0, ge=0, description="0: M - 1 (at least 2); 2: the authors'")
    cluster_init: Literal["theta-init", "client0"] = "theta-init"
    first_batch: str = Field("full", description="round 1's batch: 'full' or a record count")
    clustering: Literal["spherical", "noise-aware"] = Field(
        "noise-aware", description="round 1's mixture: one that knows each silo's own noise "
        "level (docs/algorithm.md#noise-aware-clustering), or the authors' spherical GMM")
    noise_source: Literal["plan", "estimate", "larger"] = Field(
        "larger", description="noise-aware: each silo's noise variance from its reported "
        "noise plan, estimated from its update, or the larger of the two")

    @field_validator("first_batch")
    @classmethod
    def _valid_first_batch(cls, value: str) -> str:
        if value != "full" and not (value.isdigit() and int(value) > 0):
            raise ValueError("must be 'full' or a positive integer")
        return value

    @property
    def first_round_batch(self) -> int | Literal["full"]:
        return "full" if self.first_batch == "full" else int(self.first_batch)


#: Round-1 noise variances differing by more than this factor (2x in noise std) make the
#: spherical mixture cluster silos by noise level rather than by data: on Fashion-MNIST with
#: 25 x Dist8 budgets (variances 5x apart) its round-1 ARI was 0.71 against the noise-aware
#: mixture's 1.00 (bench/RESULTS.md, noise-aware clustering).
NOISE_SPREAD_WARNING = 4.0


def _warn_if_noise_differs(planned: list[float | None]) -> None:
    """Tell the operator of a spherical run when its silos' reported round-1 noise differs
    enough for the noise-aware mixture to matter (docs/algorithm.md#noise-aware-clustering)."""
    reported = [v for v in planned if v is not None and v > 0]
    if len(reported) >= 2 and max(reported) > NOISE_SPREAD_WARNING * min(reported):
        logger.warning(
            "round 1: the silos' reported noise variances differ %.0fx (their budgets or "
            "record counts differ); the spherical mixture may cluster them by noise level. "
            "[rdpcfl] clustering = \"noise-aware\" accounts for each silo's own noise",
            max(reported) / min(reported))


@dataclass
class ClusteringOutcome:
    """What the server learnt from round 1, for results and plots
    (docs/algorithm.md#stage-1-clustering-the-round-1-updates)."""

    partitions: list[int]
    n_clusters: int
    mss: float
    mpo: float
    switch_round: int
    em_iterations: int
    converged: bool
    labels: list[int]
    responsibilities: list[list[float]]
    points: list[list[float]]
    means: list[list[float]]
    radii: list[float]
    candidate_mss: dict[int, float]
    #: "spherical" or "noise-aware"; the latter's per-silo noise variances v_i it used and
    #: its estimates v_hat_i from the updates (units of the update, squared)
    mixture: str = "spherical"
    noise_variances: list[float] | None = None
    estimated_noise_variances: list[float] | None = None
    #: with M chosen against the null (docs/algorithm.md#choice-of-m): per candidate, the
    #: evidence (log-MSS standard deviations above the null's) and the null's 95% MSS
    m_evidence: dict[int, float] | None = None
    null_mss: dict[int, float] | None = None


def _order_figures(order: ModelOrder | None) -> tuple[dict[int, float] | None,
                                                      dict[int, float] | None]:
    return (None, None) if order is None else (order.evidence, order.null_mss)


@register
class RDPCFL(Method):
    """The server side of R-DPCFL; silos do DP-SGD and their own private selection."""

    name = "rdpcfl"
    title = "R-DPCFL: cluster by round-1 gradients, then by losses (the paper's method)"
    Params = RDPCFLParams
    discovers_clusters = True
    params: RDPCFLParams

    def __init__(self, experiment: ExperimentConfig, params: RDPCFLParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        self.pi: dict[int, np.ndarray] = {}
        self.choice: dict[int, int] = {}
        self.clustering: ClusteringOutcome | None = None
        self.switch = experiment.num_server_rounds  # E_c; set after round 1
        load_mixture_code()  # here, while the silos train round 1, not in its clustering

    # --- schedule ---------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        e, p = self.experiment, self.params
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size,
                        p.first_round_batch, p.select_rounds(e.num_server_rounds),
                        p.select_ratio, e.conversion, e.budget_mode)

    def initial_clusters(self) -> int:
        """M, or (M chosen after round 1) the most it may be: round 1 sends theta_init."""
        return self.params.n_clusters or self.params.max_clusters

    def select_window(self) -> range:
        """Rounds with private selection: E_c+1 .. E_c+T_sel (exactly T_sel run and charged,
        docs/algorithm.md#stage-3-private-cluster-selection), or every round after E_c."""
        last = self.experiment.num_server_rounds
        if self.params.selection == "every-round":
            return range(self.switch + 1, last + 1)
        return range(self.switch + 1,
                     min(self.switch + self.params.select_rounds(last), last) + 1)

    def stage(self, server_round: int) -> str:
        if server_round == 1:
            return "clustering"
        if server_round <= self.switch:
            return "soft"
        if server_round in self.select_window():
            return "select"
        return "frozen"

    def tuning_round(self) -> int:
        """Round 2: round 1 is the full-batch step whose updates are clustered, at one
        learning rate for every silo (the clustering does not depend on its scale)."""
        return 2

    def round_batch(self, server_round: int) -> int | Literal["full"]:
        if server_round == 1:
            return self.params.first_round_batch
        return self.experiment.batch_size

    # --- decisions --------------------------------------------------------------------------
    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        stage = self.stage(server_round)
        if stage == "clustering":
            return dict.fromkeys(partitions, INITIAL)
        if stage == "soft":
            # A fresh draw every round, seeded per round for reproducibility
            # (docs/algorithm.md#stage-2-soft-clustering).
            rng = np.random.default_rng([self.experiment.seed, server_round])
            return {p: int(rng.choice(self.n_clusters, p=self._pi(p))) for p in partitions}
        if stage == "select":
            return dict.fromkeys(partitions, SELECT)
        return {p: self.current_cluster(p) for p in partitions}

    def _pi(self, partition: int) -> np.ndarray:
        """Soft assignment; a silo that missed round 1 is spread uniformly."""
        if partition not in self.pi:
            return np.full(self.n_clusters, 1.0 / self.n_clusters)
        return self.pi[partition]

    def current_cluster(self, partition: int) -> int:
        if partition in self.choice:
            return self.choice[partition]
        return int(np.argmax(self._pi(partition)))

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        if server_round == 1:
            self._cluster_round_one(replies)
            return
        for partition, reply in replies.items():
            if bool(reply.metrics.get("selected", 0)):
                self.choice[partition] = reply.cluster
        super().absorb(server_round, replies)

    @classmethod
    def fewest_silos(cls, params: BaseModel) -> int:
        """Round 1 clusters the silos' updates: a GMM with M components on M - 1 axes needs
        M + 1 of them, and choosing M by MSS at least 3."""
        return max(3, int(getattr(params, "n_clusters", 0)) + 1)

    def _cluster_round_one(self, replies: dict[int, TrainReply]) -> None:
        updates = {p: r.update for p, r in replies.items() if r.update is not None}
        partitions = sorted(updates)
        if len(partitions) < 3:
            raise RuntimeError(f"only {len(partitions)} silos trained round 1: cannot cluster")
        e, p = self.experiment, self.params
        candidates = range(2, min(p.max_clusters, len(partitions) - 1) + 1)
        matrix = StackedRows([updates[p] for p in partitions])  # read a column block at a time
        planned = self._planned_noise(replies, partitions)
        fitted: UpdateClusterer
        if p.clustering == "noise-aware":
            fitted = NoiseAwareClusterer(
                p.n_clusters or None, candidates, random_state=e.seed,
                n_components=p.pca_components or None, noise_source=p.noise_source)
        else:
            _warn_if_noise_differs(planned)
            fitted = UpdateClusterer(p.n_clusters or None, candidates, random_state=e.seed,
                                     n_components=p.pca_components or None)
        order = None
        if p.n_clusters == 0 and p.m_choice == "null":
            order = fit_model_order(fitted, matrix, planned, seed=e.seed)
        else:
            fitted.fit(matrix, planned)
        self.pi = {p: fitted.responsibilities_[i] for i, p in enumerate(partitions)}
        # one cluster: nothing to choose between, so no selection; every round trains it
        self.switch = (e.num_server_rounds if fitted.n_clusters_ == 1
                       else switch_round(fitted.mpo_, e.num_server_rounds))
        self.clustering = ClusteringOutcome(
            partitions, fitted.n_clusters_, fitted.mss_, fitted.mpo_, self.switch,
            fitted.n_iter_, fitted.converged_, fitted.labels_.tolist(),
            fitted.responsibilities_.tolist(), fitted.points_.tolist(), fitted.means_.tolist(),
            fitted.radii_.tolist(), fitted.candidate_mss_, p.clustering,
            *self._noise_levels(fitted), *_order_figures(order))
        self.state.models = [self._reset_model(updates, partitions)
                             for _ in range(fitted.n_clusters_)]
        logger.info("round 1 clustering: M=%d, MSS=%.3f, MPO=%.3g, E_c=%d, EM iterations=%d",
                    self.n_clusters, fitted.mss_, fitted.mpo_, self.switch, fitted.n_iter_)

    def _planned_noise(self, replies: dict[int, TrainReply],
                       partitions: list[int]) -> list[float | None]:
        """v_i from each silo's reported plan: K eta^2 z_i^2 c^2 / N_i^2 per coordinate (the
        reply's variance is at learning rate 1; docs/algorithm.md#noise-aware-clustering)."""
        rate = self.experiment.base_learning_rate**2
        reported = [replies[p].noise_variance for p in partitions]
        return [None if v is None else rate * v for v in reported]

    @staticmethod
    def _noise_levels(fitted: UpdateClusterer) -> tuple[list[float] | None, list[float] | None]:
        if not isinstance(fitted, NoiseAwareClusterer):
            return None, None
        return fitted.noise_variances_.tolist(), fitted.estimated_noise_variances_.tolist()

    def _reset_model(self, updates: dict[int, np.ndarray], partitions: list[int]) -> np.ndarray:
        """theta_init for every cluster ([001] Alg. 1 line 13), or the authors' code: the
        round-1 model of the first client (docs/algorithm.md#where-we-differ-from-the-paper)."""
        if self.params.cluster_init == "client0":
            return (self.state.initial + updates[partitions[0]]).astype(np.float32)
        return self.state.initial.copy()

    def results(self) -> dict[str, Any]:
        outcome = {} if self.clustering is None else asdict(self.clustering)
        return {**outcome, "switch_round": self.switch,
                "select_rounds": [self.select_window().start, self.select_window().stop - 1],
                "frozen_choices": dict(self.choice)}
