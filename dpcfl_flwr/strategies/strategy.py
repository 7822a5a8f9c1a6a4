"""ClusteredStrategy: a Flower Strategy that keeps M cluster models and runs any method.

Flower's own round loop (``Strategy.start``) drives the run. Each round is
:meth:`~ClusteredStrategy.configure_train` (the method assigns a cluster to every silo; this
class packs the models into Flower messages) -> the grid -> :meth:`~ClusteredStrategy.
aggregate_train` (replies checked, the method absorbs them), then the evaluate pair, which
evaluates every ``eval-every`` rounds and after the last. What Flower's loop lacks, this class
adds: the M models live here (Flower threads one ``ArrayRecord`` through its loop, which stays
theta_init); new or restarted silos are asked who they are before each round
(:class:`~.silos.SiloRoster`); the finished ``Result`` carries every cluster model.

The method (``experiment.method``, from :mod:`dpcfl_flwr.config.registry`) decides; this class only
turns its decisions into messages and folds the replies back (docs/protocol.md).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..config import registry
from ..config.settings import ExperimentConfig
from ..methods.base import INITIAL, Method, ServerState, SiloInfo, TrainReply
from ..privacy.schedule import TUNING_SELECT_RATIO, Schedule
from ..protocol import (
    ARRAYS,
    CONFIG,
    MAJORITY,
    OWN,
    SELECT,
    ModelLayout,
    WireModel,
    cluster_key,
    number,
    one_record,
    pack,
)
from .checkpoint import Checkpoint
from .replies import evaluate_reply, far_off_updates, known_number, train_reply
from .round_report import RoundReport
from .silos import SiloRoster

logger = logging.getLogger(__name__)


class RunObserver(Protocol):
    """Receives the run as it happens (the results writer, a progress display)."""

    def silos_known(self, strategy: ClusteredStrategy) -> None: ...

    def round_done(self, strategy: ClusteredStrategy, report: RoundReport) -> None: ...


@dataclass
class _Sent:
    """A round's messages in flight, by the silo (partition) each went to, and when they
    left (monotonic s)."""

    messages: dict[int, Message]
    at: float = field(default_factory=time.monotonic)

    def by_silo(self, replies: Iterable[Message]) -> dict[int, Message]:
        """``replies`` by the silo whose message each answers. Matched on the message a reply
        answers, not on its sender: the SuperLink answers in a silo's name when the silo
        cannot (its node went offline, or its session ended with the message in hand), and
        such an error reply comes from the SuperLink's own node."""
        partition_of = {m.metadata.message_id: p for p, m in self.messages.items()}
        return {partition_of[r.metadata.reply_to_message_id]: r for r in replies
                if r.metadata.reply_to_message_id in partition_of}


def _to_send(model: WireModel | None, cluster: int) -> WireModel:
    if model is None:
        raise ValueError(f"cluster {cluster} has no model to send")
    return model


class ClusteredStrategy(Strategy):
    """The server side of every method: M cluster models, the silos, Flower's hooks.

    ``experiment``: the validated run config (its ``method`` picks the method);
    ``initial``: theta_init, every cluster's starting model; ``observer``: told when the
    silos are known and after each round (the results writer)."""

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord,
                 observer: RunObserver | None = None) -> None:
        self.experiment = experiment
        self.layout = ModelLayout.of(initial)
        self.state = ServerState(self.layout.flatten(initial))
        method_class = registry.method_class(experiment.method)
        self.method: Method = method_class(experiment, experiment.params, self.state)
        self.roster = SiloRoster(experiment, self.state.silos, method_class.name,
                                 self.method.silos_needed())
        self.observer = observer
        self.reports: list[RoundReport] = []
        self._sent: _Sent | None = None  # the round's train messages
        self._evaluating: _Sent | None = None  # its evaluate messages
        #: Rounds done before this process (a resumed run): Flower's loop passes them by.
        self.completed = 0
        #: What silos key their noise plan by: the same across resumes, so a resumed silo
        #: keeps the noise it calibrated for the run (a new Flower run id would not).
        self.run_key = secrets.randbits(62)
        self._restored: dict[int, SiloInfo] = {}
        self._epsilon_target = 0.0

    # --- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """The run after its last reported round, to continue from (:meth:`resume`)."""
        return Checkpoint(self.reports[-1].round if self.reports else 0,
                          self.experiment.to_run_config(), self.run_key,
                          [m.copy() for m in self.models], self.method.state_dict(),
                          dict(self.silos), list(self.reports),
                          epsilon_target=self._epsilon_target)

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue after ``checkpoint``'s round: its models, method state, round reports and
        run key; its silos are matched by partition id as they rejoin (:meth:`discover`)."""
        self.completed = checkpoint.round
        self.state.models = [m.copy() for m in checkpoint.models]
        self.method.load_state_dict(checkpoint.method)
        self.reports = list(checkpoint.reports)
        self.run_key = checkpoint.run_key
        self._restored = dict(checkpoint.silos)
        self._epsilon_target = checkpoint.epsilon_target

    # --- what the run reads -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.method.name

    @property
    def silos(self) -> dict[int, SiloInfo]:
        return self.state.silos

    @property
    def models(self) -> list[np.ndarray]:
        return self.state.models

    @property
    def n_clusters(self) -> int:
        return len(self.state.models)

    @property
    def initial(self) -> np.ndarray:
        return self.state.initial

    @property
    def discovers_clusters(self) -> bool:
        return self.method.discovers_clusters

    def current_cluster(self, partition: int) -> int:
        return self.method.current_cluster(partition)

    def evaluates(self, server_round: int) -> bool:
        """Every ``eval-every`` rounds and after the last."""
        e = self.experiment
        return server_round % e.eval_every == 0 or server_round == e.num_server_rounds

    def evaluations(self) -> int:
        """Evaluate queries of the run: a silo with private metrics reserves budget for them."""
        return sum(self.evaluates(r) for r in range(1, self.experiment.num_server_rounds + 1))

    # --- silos ----------------------------------------------------------------------------------
    def discover(self, grid: Grid, expected: int, wait: float, required: int = 0) -> None:
        """Wait until ``expected`` silos can run, for at most ``wait`` s (see
        :meth:`.silos.SiloRoster.discover`); no silo has trained when this returns."""
        self.roster.resuming = set(self._restored)
        self.roster.discover(grid, expected, wait, required)
        self.roster.adopt(self._restored)
        if self.observer is not None:
            self.observer.silos_known(self)

    def refresh_silos(self, grid: Grid) -> list[int]:
        return self.roster.refresh_silos(grid)

    def active_partitions(self) -> list[int]:
        """The silos to train: known to be on a node now and not out of budget."""
        return sorted(p for p, s in self.silos.items() if not s.exhausted and s.node_id >= 0)

    # --- Flower's hooks: training ---------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The round's train messages, one per silo that can still train: the model of the
        cluster the method assigned it (all M when it selects privately), the round's
        settings and the run's DP schedule. ``arrays`` and ``config`` (Flower's single
        model and config) are not used: the models are the method's. None in a round a
        resumed run had completed."""
        if server_round <= self.completed:
            return []
        self.refresh_silos(grid)  # silos that (re)joined since the last round
        messages = self._train_messages(server_round)
        self._sent = _Sent(messages)
        return list(messages.values())

    def _train_messages(self, server_round: int) -> dict[int, Message]:
        assignment = self.method.assign(server_round, self.active_partitions())
        packed = cache(self._model_record)  # each model packed once a round, its bytes shared
        extra = self.method.extra_models(server_round)  # after assign: it may size the models
        messages = {}
        for partition, cluster in assignment.items():
            if cluster == SELECT:
                models = {cluster_key(m): _to_send(packed(m), m) for m in range(self.n_clusters)}
            else:
                model = packed(cluster)
                models = {} if model is None else {ARRAYS: model}
            content = one_record(CONFIG, self.train_config(server_round, cluster, partition),
                                 {**models, **extra})
            messages[partition] = Message(content, dst_node_id=self.silos[partition].node_id,
                                          message_type="train", ttl=self._ttl())
        return messages

    def train_config(self, server_round: int, cluster: int,
                     partition: int | None = None) -> dict[str, Any]:
        """The fields of a train message to silo ``partition`` (docs/protocol.md#train)."""
        e, method = self.experiment, self.method
        return {
            "server-round": server_round, "stage": method.stage(server_round),
            "cluster": cluster, "round-batch": str(method.round_batch(server_round)),
            "clip-norm": e.clip_norm,
            "personal": int(method.personal), "run-key": self.run_key,
            **replace(self._schedule(), evaluations=self.evaluations(),
                      epsilon_target=self.epsilon_target(), accountant=e.accountant).to_config(),
            **self._learning_rate(server_round, partition),
            **method.silo_settings(server_round, cluster),
        }

    def _schedule(self) -> Schedule:
        """The method's schedule, with the learning rate's choice where silos choose it (and
        a budget share for its selection where the method plans none)."""
        schedule, grid = self.method.schedule(), self.learning_rate_grid()
        if not grid:
            return schedule
        return replace(schedule, tune_candidates=len(grid),
                       select_ratio=schedule.select_ratio or TUNING_SELECT_RATIO)

    def learning_rate_grid(self) -> tuple[float, ...]:
        """The learning rates silos choose among (empty: the run sets one, or its method
        lets no silo choose)."""
        return self.experiment.tuned_learning_rates if self.method.chooses_learning_rate() \
            else ()

    def _learning_rate(self, server_round: int, partition: int | None) -> dict[str, Any]:
        """The round's learning rate for a silo: the run's; else, once the silo has chosen,
        the federation's (:meth:`federation_learning_rate`); else, from the method's tuning
        round on, the candidates to choose among (docs/algorithm.md#choosing-the-learning-rate)."""
        grid, base = self.learning_rate_grid(), self.experiment.base_learning_rate
        chosen = None if partition is None else self.silos[partition].learning_rate
        if not grid:
            return {"learning-rate": base}
        if chosen is not None:
            return {"learning-rate": self.federation_learning_rate() or chosen}
        if server_round < self.method.tuning_round():
            return {"learning-rate": base}
        return {"learning-rate": base, "learning-rate-candidates": ",".join(map(repr, grid))}

    def federation_learning_rate(self) -> float | None:
        """The candidate most silos chose (the larger among ties), or None before any chose.

        One silo's choice rests on one round of its own records, a noisy score where it holds
        few (on 119 records of 8 x 8 digits each silo's pick ranged over all four candidates);
        the silos' votes together are a steadier one. It is post-processing of their DP
        choices and costs nothing more."""
        votes = Counter(s.learning_rate for s in self.silos.values()
                        if s.learning_rate is not None)
        if not votes:
            return None
        return max(votes, key=lambda rate: (votes[rate], rate))

    def epsilon_target(self) -> float:
        """``aggregation = "min-eps"``: the smallest budget the silos claim, fixed when first
        asked (a silo's noise plan must not change within a run); else 0 (own budgets)."""
        if self.experiment.aggregation == "min-eps" and not self._epsilon_target:
            self._epsilon_target = min(s.epsilon_budget for s in self.silos.values())
        return self._epsilon_target

    def _model_record(self, cluster: int) -> WireModel | None:
        if cluster in (OWN, MAJORITY):  # the silo's own model, or its class: no weights
            return None
        return pack(self.initial if cluster == INITIAL else self.models[cluster])

    def _ttl(self) -> float:
        """A round's messages expire with the round: a silo that restarts must not pick up
        (and spend budget on) a round the server stopped waiting for."""
        return self.experiment.round_timeout + 5.0

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the replies and let the method absorb them. Returns no ArrayRecord: the M
        cluster models stay here (the run's ``Result`` gets them at the end)."""
        if server_round <= self.completed:
            return None, None
        sent, self._sent = self._sent or _Sent({}), None
        keyed = sent.by_silo(replies)
        missing = sorted(set(sent.messages) - set(keyed))
        report = self._fold_train(server_round, keyed, missing, time.monotonic() - sent.at)
        return None, MetricRecord({"silos-trained": len(report.trained)})

    def _fold_train(self, server_round: int, replies: dict[int, Message], missing: list[int],
                    seconds: float) -> RoundReport:
        started = time.monotonic()
        good: dict[int, TrainReply] = {}
        refused: list[int] = []
        for partition, message in sorted(replies.items()):
            silo = self.silos[partition]
            if message.has_error():
                self.roster.note_error(server_round, silo, message, refused)
                continue
            try:
                reply = train_reply(message, self.layout, self.n_clusters,
                                    self.experiment.clip_norm, self.experiment.num_classes)
            except ValueError as exc:
                self._drop_unusable(server_round, partition, str(exc))
                continue
            good[partition] = reply
            silo.epsilon_spent = number(reply.metrics, "epsilon-spent")
            silo.noise_multiplier = number(reply.metrics, "noise-multiplier")
            batch = known_number(reply.metrics, "batch-size")
            silo.batch_size = None if batch is None else int(batch)
            silo.dprivacy_leakage = known_number(reply.metrics, "dprivacy-leakage")
            self._note_learning_rate(server_round, partition, reply)
            if reply.cluster == MAJORITY:
                silo.majority_class = int(number(reply.metrics, "majority-class"))
        for partition, multiple in far_off_updates(good).items():
            del good[partition]
            self._drop_unusable(server_round, partition, f"its update's norm is {multiple:.3g} "
                                "times the median of the round's updates")
        for partition in missing:
            self.silos[partition].dropped_rounds.append(server_round)
            logger.warning("round %d: silo %d did not reply (dropped)", server_round, partition)
        self.roster.check_noise_multipliers(server_round, list(good))
        self.method.absorb(server_round, good)
        report = RoundReport(
            server_round, self.method.stage(server_round), seconds,
            {p: r.cluster for p, r in good.items()},
            {p: v for p, r in good.items()
             if (v := known_number(r.metrics, "val-accuracy")) is not None},
            refused, sorted(missing), server_seconds=time.monotonic() - started,
            client_cpu_seconds={p: number(r.metrics, "cpu-seconds") for p, r in good.items()
                                if "cpu-seconds" in r.metrics},
            aggregation=dict(self.state.aggregation),
        )
        self.reports.append(report)
        return report

    def _drop_unusable(self, server_round: int, partition: int, reason: str) -> None:
        """Silo ``partition`` loses ``server_round``: its reply cannot be used, for ``reason``."""
        self.silos[partition].dropped_rounds.append(server_round)
        logger.error("round %d: silo %d sent a reply the server cannot use (dropped): %s",
                     server_round, partition, reason)

    # --- Flower's hooks: evaluation ---------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Every silo's evaluate message (the model it uses now), in evaluation rounds; none
        in the others."""
        if server_round <= self.completed or not self.evaluates(server_round):
            return []
        packed = cache(self._model_record)
        messages = {}
        for partition in sorted(p for p, s in self.silos.items() if s.node_id >= 0):
            cluster = self.current_cluster(partition)
            model = packed(cluster)
            content = one_record(CONFIG, {"server-round": server_round, "cluster": cluster},
                                 {} if model is None else {ARRAYS: model})
            messages[partition] = Message(content, dst_node_id=self.silos[partition].node_id,
                                          message_type="evaluate", ttl=self._ttl())
        self._evaluating = _Sent(messages)
        return list(messages.values())

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Fold the evaluation replies into the round's report (in evaluation rounds), log the
        round and tell the observer (which keeps the results and the checkpoint); the mean
        test accuracy goes to Flower's history."""
        if server_round <= self.completed:
            return None
        report = self.reports[-1]
        if self.evaluates(server_round):
            sent, self._evaluating = self._evaluating or _Sent({}), None
            self._fold_evaluate(report, sent.by_silo(replies))
            report.evaluate_seconds = time.monotonic() - sent.at
        self._log_round(report)
        if self.observer is not None:
            self.observer.round_done(self, report)
        if not report.test_accuracy:
            return None
        figures = {"test-accuracy": report.test_accuracy,
                   "test-balanced-accuracy": report.test_balanced_accuracy,
                   "test-auroc": report.test_auroc}
        return MetricRecord({key: float(np.mean(list(values.values())))
                             for key, values in figures.items() if values})

    def _fold_evaluate(self, report: RoundReport, replies: dict[int, Message]) -> None:
        """The round's evaluation replies into ``report`` and the silos' records; a reply
        that is an error or fails its checks is logged and left out."""
        report.test_accuracy = {}
        for partition, message in replies.items():
            if message.has_error():
                logger.error("evaluation on silo %d failed: %s", partition, message.error.reason)
                continue
            try:
                tested = evaluate_reply(message, self.experiment.num_classes)
            except ValueError as exc:
                logger.error("evaluation on silo %d: a reply the server cannot use: %s",
                             partition, exc)
                continue
            silo = self.silos[partition]
            silo.test_accuracy, silo.test_loss = tested.accuracy, tested.loss
            silo.epsilon_spent = tested.epsilon_spent
            silo.test_balanced_accuracy, silo.test_auroc = tested.balanced_accuracy, tested.auroc
            report.test_accuracy[partition] = tested.accuracy
            if tested.balanced_accuracy is not None:
                report.test_balanced_accuracy[partition] = tested.balanced_accuracy
            if tested.auroc is not None:
                report.test_auroc[partition] = tested.auroc

    def _log_round(self, report: RoundReport) -> None:
        tested = report.test_accuracy
        accuracy = f", test acc {np.mean(list(tested.values())):.3f}" if tested else ""
        logger.info("round %d [%s]: %d trained, cluster sizes %s, %.1f s%s", report.round,
                    report.stage, len(report.trained), report.cluster_sizes(self.n_clusters),
                    report.seconds, accuracy)

    def _note_learning_rate(self, server_round: int, partition: int,
                            reply: TrainReply) -> None:
        """Keep the learning rate a silo chose (one of the candidates it was sent; a DP
        release, the exponential mechanism's), to send it in its later rounds."""
        silo, grid = self.silos[partition], self.learning_rate_grid()
        rate = known_number(reply.metrics, "learning-rate")
        if silo.learning_rate is not None or not grid or rate is None:
            return
        if not any(math.isclose(rate, g, rel_tol=1e-9) for g in grid):
            return  # a round before its choice, trained at the base rate
        silo.learning_rate = rate
        logger.info("round %d: silo %d chose learning rate %.4g", server_round, partition,
                    rate)

    # --- the run ------------------------------------------------------------------------------
    def summary(self) -> None:
        e = self.experiment
        own = "".join(f", {key}={value}" for key, value in
                      e.params.model_dump(by_alias=True).items())
        grid = self.learning_rate_grid()
        rate = (f"lr chosen by each silo among {', '.join(f'{g:.3g}' for g in grid)}"
                if grid else f"lr={e.base_learning_rate:g}")
        logger.info("%s: %d silos, M=%d, E=%d, eps=%g, delta=%g, b=%d, %s, c=%g%s",
                    self.name, len(self.silos), self.n_clusters, e.num_server_rounds, e.epsilon,
                    e.delta, e.batch_size, rate, e.clip_norm, own)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        """Flower's round loop, unchanged; then the result's arrays are the cluster models
        (``cluster-<m>.<tensor>``; none for a method whose silos keep their models)."""
        result = super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                               evaluate_config, evaluate_fn)
        result.arrays = self.cluster_arrays()
        return result

    def cluster_arrays(self) -> ArrayRecord:
        """Every cluster model as named tensors, keys ``cluster-<m>.<tensor name>``."""
        record = ArrayRecord()
        for m, model in enumerate(self.models):
            for key, value in self.layout.unflatten(model).items():
                record[f"{cluster_key(m)}.{key}"] = Array(value)
        return record
