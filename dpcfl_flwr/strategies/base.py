"""The shared machinery of our strategies: silos, M cluster models, rounds, evaluation.

Subclasses are pure decision logic: which cluster each silo trains in a round
(:meth:`ClusteredStrategy.assign`), what the server learns from the replies
(:meth:`ClusteredStrategy.absorb`) and which model a silo would use
(:meth:`ClusteredStrategy.current_cluster`). This base class turns those decisions into Flower
messages, folds the replies back into per-cluster models, and drives the rounds.

Silos are keyed by their partition id, not by Flower's node id: a silo that restarts comes
back with a new node id but the same identity, its ledger and its cluster assignment.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Literal, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..config import ExperimentConfig
from ..protocol import (
    ARRAYS,
    BUDGET_EXCEEDED,
    CONFIG,
    METRICS,
    OWN,
    SELECT,
    SILO,
    UPDATE,
    ModelLayout,
    WireModel,
    arrays_from_vector,
    cluster_key,
    metrics_of,
    model_records,
    number,
    one_record,
    pack,
)
from ..silo import Schedule
from .aggregation import cluster_means
from .exchange import exchange, pause

logger = logging.getLogger(__name__)

#: Assignment of round 1 in R-DPCFL: train theta_init, belong to no cluster yet.
INITIAL = -2
#: How often a node whose silo could not start is asked again (its operator may fix it).
RETRY_FAILED_SECONDS = 30.0


class TooFewSilos(RuntimeError):
    """Fewer silos can run than the run needs: it stops before any silo spends budget."""


@dataclass
class FailedNode:
    """A node whose silo answered the query with an error (it cannot start)."""

    reason: str
    asked: float  # time.monotonic() of that query


def _nodes(nodes: list[int], shown: int = 4) -> str:
    listed = ", ".join(str(n) for n in sorted(nodes)[:shown])
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return f"node{'s' if len(nodes) > 1 else ''} {listed}{more}"


@dataclass
class SiloInfo:
    """What the server knows about a silo (from its query reply and its rounds)."""

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
    noise_multiplier: float | None = None
    #: Epsilon its ledger held when it joined this run (earlier runs' spend): the budget this
    #: run can use is what is left, so its noise is larger than a fresh silo's.
    epsilon_spent_before: float = 0.0


@dataclass
class RoundReport:
    """What happened in one training round, for logs, progress and the results files."""

    round: int
    stage: str
    seconds: float
    trained: dict[int, int]  # partition -> cluster it trained
    val_accuracy: dict[int, float]  # of the silos that report one (private metrics do not)
    refused: list[int]
    dropped: list[int]
    server_seconds: float = 0.0
    test_accuracy: dict[int, float] | None = None
    client_cpu_seconds: dict[int, float] = field(default_factory=dict)

    def cluster_sizes(self, n_clusters: int) -> list[int]:
        counts = np.bincount([c for c in self.trained.values() if c >= 0], minlength=n_clusters)
        return counts.tolist()


class RunObserver(Protocol):
    """Receives the run as it happens (the results writer, a progress display)."""

    def silos_known(self, strategy: ClusteredStrategy) -> None: ...

    def round_done(self, strategy: ClusteredStrategy, report: RoundReport) -> None: ...


@dataclass
class TrainReply:
    cluster: int
    update: np.ndarray | None  # None when the silo keeps its model (Local)
    metrics: dict[str, Any]


def _reply_numbers(message: Message, keys: tuple[str, ...],
                   record: str = METRICS) -> tuple[Mapping[str, Any], list[float]]:
    """A reply's record of numbers ``record`` (see :func:`~..protocol.metrics_of`) and its
    fields ``keys`` as numbers; ValueError naming what is missing or not a number."""
    try:
        metrics = metrics_of(message, record)
        return metrics, [number(metrics, key) for key in keys]
    except KeyError as exc:
        raise ValueError(f"no {exc} in the reply") from exc


def known_number(record: Mapping[str, Any], key: str) -> float | None:
    """An optional number of a reply: None when it is absent, not a number or not finite (a
    silo that keeps its metrics private sends no ``val-accuracy``)."""
    value = record.get(key)
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    return None


def _to_send(model: WireModel | None, cluster: int) -> WireModel:
    if model is None:
        raise ValueError(f"cluster {cluster} has no model to send")
    return model


# what a silo says of itself when queried, in SiloInfo's order
SILO_FIELDS = ("partition-id", "true-cluster", "num-train", "epsilon-budget", "delta",
               "epsilon-spent")


class ClusteredStrategy(Strategy):
    """M cluster models kept by the server; subclasses decide who trains which."""

    name = "clustered"
    #: Silos keep their trained model and send no update (Local).
    personal = False
    #: Whether the method learns the cluster structure (reported as found / not found).
    discovers_clusters = False

    def __init__(self, experiment: ExperimentConfig, initial: ArrayRecord, n_clusters: int,
                 observer: RunObserver | None = None) -> None:
        self.experiment = experiment
        self.layout = ModelLayout.of(initial)
        self.initial = self.layout.flatten(initial)
        self.n_clusters = n_clusters
        self.models: list[np.ndarray] = [self.initial.copy() for _ in range(n_clusters)]
        self.silos: dict[int, SiloInfo] = {}
        self.failed: dict[int, FailedNode] = {}  # node id -> why its silo cannot start
        self.observer = observer
        self.reports: list[RoundReport] = []
        self.rng = np.random.default_rng([experiment.seed, 7919])
        self._noise_checked: set[int] = set()  # silos whose z was compared with the others'

    # --- decisions: subclasses --------------------------------------------------------------
    def schedule(self) -> Schedule:
        """The DP schedule every silo calibrates its noise for."""
        e = self.experiment
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size, e.batch_size, 0,
                        e.select_ratio, e.conversion, e.budget_mode)

    def stage(self, server_round: int) -> str:
        return "train"

    def round_batch(self, server_round: int) -> int | Literal["full"]:
        return self.experiment.batch_size

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        """Cluster index (or SELECT / INITIAL) each listed silo trains this round."""
        raise NotImplementedError

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        """Learn from a round's replies; by default average updates per trained cluster."""
        self.models = cluster_means(self.models, {p: (r.cluster, r.update) for p, r in
                                                  replies.items() if r.update is not None},
                                    self._weights(replies))

    def current_cluster(self, partition: int) -> int:
        """The cluster model silo ``partition`` would use now (what it is evaluated on)."""
        raise NotImplementedError

    def extra_models(self, server_round: int) -> dict[str, WireModel]:
        """Additional models of every train message of a round (MR-MTL's anchor)."""
        return {}

    # --- helpers ------------------------------------------------------------------------------
    def _weights(self, replies: dict[int, TrainReply]) -> dict[int, float]:
        if self.experiment.aggregation == "samples":
            return {p: float(self.silos[p].num_train) for p in replies}
        return {p: 1.0 for p in replies}

    def active_partitions(self) -> list[int]:
        return sorted(p for p, s in self.silos.items() if not s.exhausted)

    def model_record(self, cluster: int) -> WireModel | None:
        if cluster == OWN:
            return None
        return pack(self.initial if cluster == INITIAL else self.models[cluster])

    def train_config(self, server_round: int, cluster: int) -> dict[str, Any]:
        e = self.experiment
        return {
            "server-round": server_round, "stage": self.stage(server_round), "cluster": cluster,
            "round-batch": str(self.round_batch(server_round)),
            "learning-rate": e.learning_rate, "clip-norm": e.clip_norm,
            "personal": int(self.personal),
            **replace(self.schedule(), evaluations=self.evaluations()).to_config(),
        }

    def evaluations(self) -> int:
        """Evaluate queries of the run (every ``eval-every`` rounds and after the last): a
        silo with private metrics reserves budget for them."""
        rounds, every = self.experiment.num_server_rounds, self.experiment.eval_every
        return rounds // every + (rounds % every != 0)

    def _ttl(self) -> float:
        """A round's messages expire with the round: a silo that restarts must not pick up
        (and spend budget on) a round the server stopped waiting for."""
        return self.experiment.round_timeout + 5.0

    # --- Flower Strategy API ------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._train_messages(server_round).values()

    def _train_messages(self, server_round: int) -> dict[int, Message]:
        assignment = self.assign(server_round, self.active_partitions())
        packed = cache(self.model_record)  # each model packed once a round, its bytes shared
        extra = self.extra_models(server_round)  # after assign: it may size the models
        messages = {}
        for partition, cluster in assignment.items():
            if cluster == SELECT:
                models = {cluster_key(m): _to_send(packed(m), m) for m in range(self.n_clusters)}
            else:
                model = packed(cluster)
                models = {} if model is None else {ARRAYS: model}
            content = one_record(CONFIG, self.train_config(server_round, cluster),
                                 {**models, **extra})
            messages[partition] = Message(content, dst_node_id=self.silos[partition].node_id,
                                          message_type="train", ttl=self._ttl())
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        by_node = {s.node_id: p for p, s in self.silos.items()}
        keyed = {by_node[m.metadata.src_node_id]: m for m in replies
                 if m.metadata.src_node_id in by_node}
        report = self._fold_train(server_round, keyed, [], 0.0)
        return None, MetricRecord({"silos-trained": len(report.trained)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._evaluate_messages(server_round).values()

    def _evaluate_messages(self, server_round: int) -> dict[int, Message]:
        packed = cache(self.model_record)
        messages = {}
        for partition in sorted(self.silos):
            cluster = self.current_cluster(partition)
            model = packed(cluster)
            content = one_record(CONFIG, {"server-round": server_round, "cluster": cluster},
                                 {} if model is None else {ARRAYS: model})
            messages[partition] = Message(content, dst_node_id=self.silos[partition].node_id,
                                          message_type="evaluate", ttl=self._ttl())
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        by_node = {s.node_id: p for p, s in self.silos.items()}
        accuracy = self._fold_evaluate({by_node[m.metadata.src_node_id]: m for m in replies
                                        if m.metadata.src_node_id in by_node})
        if not accuracy:
            return None
        return MetricRecord({"test-accuracy": float(np.mean(list(accuracy.values())))})

    def summary(self) -> None:
        e = self.experiment
        logger.info("%s: %d silos, M=%d, E=%d, eps=%g, delta=%g, b=%d, b1=%s, lr=%g, c=%g",
                    self.name, len(self.silos), self.n_clusters, e.num_server_rounds, e.epsilon,
                    e.delta, e.batch_size, e.first_batch, e.learning_rate, e.clip_norm)

    # --- folding replies ------------------------------------------------------------------------
    def _fold_train(self, server_round: int, replies: dict[int, Message], missing: list[int],
                    seconds: float) -> RoundReport:
        started = time.monotonic()
        good: dict[int, TrainReply] = {}
        refused: list[int] = []
        for partition, message in sorted(replies.items()):
            silo = self.silos[partition]
            if message.has_error():
                self._log_error(server_round, silo, message, refused)
                continue
            try:
                reply = self._train_reply(message)
            except ValueError as exc:
                silo.dropped_rounds.append(server_round)
                logger.error("round %d: silo %d sent a reply the server cannot use (dropped): "
                             "%s", server_round, partition, exc)
                continue
            good[partition] = reply
            silo.epsilon_spent = number(reply.metrics, "epsilon-spent")
            silo.noise_multiplier = number(reply.metrics, "noise-multiplier")
        for partition in missing:
            self.silos[partition].dropped_rounds.append(server_round)
            logger.warning("round %d: silo %d did not reply (dropped)", server_round, partition)
        self._check_noise_multipliers(server_round, list(good))
        self.absorb(server_round, good)
        report = RoundReport(
            server_round, self.stage(server_round), seconds,
            {p: r.cluster for p, r in good.items()},
            {p: v for p, r in good.items()
             if (v := known_number(r.metrics, "val-accuracy")) is not None},
            refused, sorted(missing), server_seconds=time.monotonic() - started,
            client_cpu_seconds={p: number(r.metrics, "cpu-seconds") for p, r in good.items()
                                if "cpu-seconds" in r.metrics},
        )
        self.reports.append(report)
        return report

    def _check_noise_multipliers(self, server_round: int, replied: list[int]) -> None:
        """Log, once per silo, a silo whose noise multiplier z differs from the one most silos
        use: it calibrated for a smaller budget (spent in an earlier run) or another data size,
        so its updates are noisier than the others'."""
        new = [p for p in replied if p not in self._noise_checked]
        self._noise_checked.update(new)
        known = {p: round(s.noise_multiplier, 4) for p, s in self.silos.items()
                 if s.noise_multiplier is not None}
        counts = Counter(known.values())
        if len(counts) < 2:
            return
        usual = max(counts, key=lambda z: (counts[z], -z))
        for partition in new:
            if known.get(partition, usual) != usual:
                silo = self.silos[partition]
                logger.warning(
                    "round %d: silo %d trains with noise multiplier z=%.4g, %d other silo(s) "
                    "with %.4g (its budget eps %g, %.4g spent before this run; %d training "
                    "records)", server_round, partition, known[partition], counts[usual],
                    usual, silo.epsilon_budget, silo.epsilon_spent_before, silo.num_train)

    def _train_reply(self, message: Message) -> TrainReply:
        """A silo's train reply, checked before it can touch a cluster model: one silo running
        other code (or broken arithmetic) must cost its own round, not the run or, through a
        NaN in an average, every silo's model. Only ``cluster``, ``epsilon-spent`` and
        ``noise-multiplier`` must be there; a silo's own numbers about its data (validation
        accuracy and loss) are optional."""
        metrics, numbers = _reply_numbers(
            message, ("cluster", "epsilon-spent", "noise-multiplier"))
        cluster = int(numbers[0])
        models = model_records(message.content)
        update = self.layout.flatten(models[UPDATE]) if UPDATE in models else None
        if cluster not in (INITIAL, OWN) and not 0 <= cluster < self.n_clusters:
            raise ValueError(f"it trained cluster {cluster}, this run has {self.n_clusters}")
        if update is not None and not np.isfinite(update).all():
            raise ValueError("its update has non-finite values")
        fields = {k: v for k, v in metrics.items() if not isinstance(v, bytes)}  # not the update
        return TrainReply(cluster, update, fields)

    def _log_error(self, server_round: int, silo: SiloInfo, message: Message,
                   refused: list[int]) -> None:
        reason = message.error.reason
        if message.error.code == BUDGET_EXCEEDED:
            silo.exhausted = True
            silo.refused_rounds.append(server_round)
            refused.append(silo.partition)
            logger.warning("round %d: silo %d refused: %s", server_round, silo.partition, reason)
        else:
            silo.dropped_rounds.append(server_round)
            logger.error("round %d: silo %d failed (code %d): %s", server_round, silo.partition,
                         message.error.code, reason)

    def _fold_evaluate(self, replies: dict[int, Message]) -> dict[int, float]:
        accuracy = {}
        for partition, message in replies.items():
            if message.has_error():
                logger.error("evaluation on silo %d failed: %s", partition, message.error.reason)
                continue
            try:
                _, values = _reply_numbers(message, ("test-accuracy", "test-loss",
                                                     "epsilon-spent"))
            except ValueError as exc:
                logger.error("evaluation on silo %d: a reply the server cannot use: %s",
                             partition, exc)
                continue
            silo = self.silos[partition]
            silo.test_accuracy, silo.test_loss, silo.epsilon_spent = values
            accuracy[partition] = silo.test_accuracy
        return accuracy

    # --- silos ------------------------------------------------------------------------------------
    def silos_needed(self) -> int:
        """The fewest silos this method can run with; a method that clusters silos says more."""
        return 1

    def discover(self, grid: Grid, expected: int, wait: float, required: int = 0) -> None:
        """Wait until ``expected`` silos can run, for at most ``wait`` s, or until every node
        present has answered (the ones that cannot start with their reason); then go on with
        the silos that can run, or raise :class:`TooFewSilos` when they are fewer than
        ``required`` or :meth:`silos_needed`. No silo has trained when this returns."""
        needed = max(required, self.silos_needed())
        if needed > self.experiment.topology.num_clients:
            raise TooFewSilos(f"at least {needed} silos needed{self._why(needed)}, but the "
                              f"topology {self.experiment.clusters} has "
                              f"{self.experiment.topology.num_clients}")
        target = max(expected, needed)
        deadline = time.monotonic() + wait
        while True:
            present = self.refresh_silos(grid)
            answered = all(n in self.failed or n in self._known_nodes() for n in present)
            if (len(self.silos) >= target or time.monotonic() >= deadline
                    or (answered and len(present) >= target)):
                break
            pause(0.5)
        if len(self.silos) < needed:
            raise TooFewSilos(self._too_few(present, expected, needed, wait))
        if len(self.silos) < expected:
            logger.warning("%s; going on with them", self._silo_count(present, expected, wait))
        if self.observer is not None:
            self.observer.silos_known(self)

    def _silo_count(self, present: list[int], expected: int, wait: float) -> str:
        """'3 of 21 silos can run (18 failed to start: <reason> (nodes ...))', one line."""
        known = self._known_nodes()
        by_reason: dict[str, list[int]] = {}
        for node in present:
            if node in self.failed and node not in known:
                by_reason.setdefault(self.failed[node].reason, []).append(node)
        failed = sum(len(nodes) for nodes in by_reason.values())
        silent = len([n for n in present if n not in known and n not in self.failed])
        parts = []
        if failed:
            parts.append(f"{failed} failed to start: " + "; ".join(
                f"{reason} ({_nodes(nodes)})" for reason, nodes in by_reason.items()))
        if silent:
            parts.append(f"{silent} did not answer")
        if len(present) < expected:
            parts.append(f"{expected - len(present)} did not connect within {wait:g} s")
        detail = f" ({'; '.join(parts)})" if parts else ""
        return f"{len(self.silos)} of {max(expected, len(present))} silos can run{detail}"

    def _too_few(self, present: list[int], expected: int, needed: int, wait: float) -> str:
        count = self._silo_count(present, expected, wait)
        return f"{count}; at least {needed} needed{self._why(needed)}"

    def _why(self, needed: int) -> str:
        if needed > self.silos_needed():
            return f" (required-clients = {needed})"
        return f" ({self.name} needs {needed})" if needed > 1 else ""

    def _known_nodes(self) -> set[int]:
        return {s.node_id for s in self.silos.values()}

    def refresh_silos(self, grid: Grid) -> list[int]:
        """Query the nodes the server has not heard from (new silos, or restarted ones), and
        again every :data:`RETRY_FAILED_SECONDS` the nodes whose silo could not start; returns
        the ids of the nodes present."""
        present = list(grid.get_node_ids())
        for gone in set(self.failed) - set(present):
            del self.failed[gone]
        known = self._known_nodes()
        now = time.monotonic()
        ask = [n for n in present if n not in known and (
            n not in self.failed or now - self.failed[n].asked >= RETRY_FAILED_SECONDS)]
        if not ask:
            return present
        messages = {node: Message(RecordDict({CONFIG: ConfigRecord({"server-round": 0})}),
                                  dst_node_id=node, message_type="query") for node in ask}
        result = exchange(grid, messages, timeout=min(self.experiment.round_timeout, 600.0))
        for node, message in result.replies.items():
            if message.has_error():
                self._cannot_start(node, message.error.reason or f"error code {message.error.code}",
                                   now)
                continue
            try:
                _, fields = _reply_numbers(message, SILO_FIELDS, SILO)
            except ValueError as exc:
                self._cannot_start(node, f"it described itself in a way the server cannot use: "
                                         f"{exc}", now)
                continue
            holder = self.silos.get(int(fields[0]))
            if holder is not None and holder.node_id != node and holder.node_id in present:
                self._cannot_start(node, f"partition {int(fields[0])} is already node "
                                         f"{holder.node_id}'s, which is still connected: two "
                                         "silos cannot share one partition id", now)
                continue
            self.failed.pop(node, None)
            self._register(node, fields)
        return present

    def _cannot_start(self, node: int, reason: str, asked: float) -> None:
        """Remember why ``node``'s silo cannot start; say so once (and when the reason changes),
        not at every query."""
        reason = " ".join(str(reason).split())  # one log line, whatever the silo sent
        previous = self.failed.get(node)
        self.failed[node] = FailedNode(reason, asked)
        if previous is None or previous.reason != reason:
            logger.error("silo on node %d cannot start: %s", node, reason)

    def _register(self, node: int, fields: list[float]) -> None:
        """``fields``: the silo's SILO_FIELDS, in that order."""
        partition, cluster, num_train = (int(value) for value in fields[:3])
        budget, delta, spent = fields[3:]
        if partition in self.silos:
            logger.warning("silo %d rejoined as node %d", partition, node)
            self.silos[partition].node_id = node
            self.silos[partition].epsilon_spent = spent
            return
        self.silos[partition] = SiloInfo(partition, node, cluster, num_train, budget, delta, spent,
                                         epsilon_spent_before=spent)
        if spent > 0:
            logger.warning("silo %d starts with eps %.4g of %g already spent (earlier runs): "
                           "this run can use the %.4g left, with larger noise", partition,
                           spent, budget, max(budget - spent, 0.0))

    # --- the rounds -----------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        """Drive all rounds; keeps the M models itself (Flower's loop threads only one)."""
        self.summary()
        result = Result()
        for server_round in range(1, num_rounds + 1):
            self.refresh_silos(grid)
            sent = self._train_messages(server_round)
            done = exchange(grid, sent, timeout)
            report = self._fold_train(server_round, done.replies, done.missing, done.seconds)
            result.train_metrics_clientapp[server_round] = MetricRecord(
                {"silos-trained": len(report.trained)})
            if server_round % self.experiment.eval_every == 0 or server_round == num_rounds:
                evaluated = exchange(grid, self._evaluate_messages(server_round), timeout)
                report.test_accuracy = self._fold_evaluate(evaluated.replies)
                if report.test_accuracy:
                    result.evaluate_metrics_clientapp[server_round] = MetricRecord(
                        {"test-accuracy": float(np.mean(list(report.test_accuracy.values())))})
            self._log_round(report)
            if self.observer is not None:
                self.observer.round_done(self, report)
        if self.models:
            result.arrays = arrays_from_vector(self.models[0], self.layout)
        return result

    def _log_round(self, report: RoundReport) -> None:
        tested = report.test_accuracy
        accuracy = f", test acc {np.mean(list(tested.values())):.3f}" if tested else ""
        logger.info("round %d [%s]: %d trained, cluster sizes %s, %.1f s%s", report.round,
                    report.stage, len(report.trained), report.cluster_sizes(self.n_clusters),
                    report.seconds, accuracy)
