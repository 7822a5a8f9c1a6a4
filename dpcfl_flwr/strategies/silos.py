"""Which silos a run has: asking the nodes who they are, and waiting for enough of them.

Silos are keyed by their partition id, not by Flower's node id: a silo that restarts comes
back with a new node id but the same identity, its ledger and its cluster assignment. A node
whose silo cannot start (its answer to the ``query`` message is an error) is asked again every
:data:`RETRY_FAILED_SECONDS`, since its operator may fix it while the run waits.

Not every error reply is the silo's answer. The SuperLink answers for a node that went
offline with the query in its queue (Flower's ``NODE_UNAVAILABLE`` and the two
message-unavailable codes), and so it does for a node whose session ended with the query in
hand (flower_compat/ended_sessions.py). That happens when a silo reconnects: after a
SuperLink restart, a node stays listed as online until its last session's heartbeat lapses,
and only then can its SuperNode start a new one. Such a node has not answered: the wait goes
on for it, and it is asked again after :data:`RETRY_UNREACHABLE_SECONDS`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from ..config.settings import ExperimentConfig
from ..methods.base import SiloInfo
from ..protocol import BUDGET_EXCEEDED, CONFIG, NOT_ANSWERED, ROUND_REPEATED, SILO
from .exchange import exchange, pause
from .replies import reply_numbers

logger = logging.getLogger(__name__)

#: How often (s) a node whose silo could not start is asked again (its operator may fix it).
RETRY_FAILED_SECONDS = 30.0
#: How often (s) a node the SuperLink answered for (it was offline) is asked again.
RETRY_UNREACHABLE_SECONDS = 5.0

# what a silo says of itself when queried, in SiloInfo's order
SILO_FIELDS = ("partition-id", "true-cluster", "num-train", "epsilon-budget", "delta",
               "epsilon-spent")


class TooFewSilos(RuntimeError):
    """Fewer silos can run than the run needs: it stops before any silo spends budget."""


@dataclass
class FailedNode:
    """A node whose query came back as an error: its silo's (it cannot start), or the
    SuperLink's for a silo that did not answer (``answered`` False)."""

    reason: str
    asked: float  # time.monotonic() of that query, s
    answered: bool = True

    def due(self, now: float) -> bool:
        """Whether the node is to be asked again at ``now`` (time.monotonic(), s)."""
        retry = RETRY_FAILED_SECONDS if self.answered else RETRY_UNREACHABLE_SECONDS
        return now - self.asked >= retry


def _one_line(reason: object) -> str:
    """A failure's reason as one log line, whatever the silo or the SuperLink sent."""
    return " ".join(str(reason).split())


def _nodes(nodes: list[int], shown: int = 4) -> str:
    listed = ", ".join(str(n) for n in sorted(nodes)[:shown])
    more = f" and {len(nodes) - shown} more" if len(nodes) > shown else ""
    return f"node{'s' if len(nodes) > 1 else ''} {listed}{more}"


class SiloRoster:
    """The silos of a run (``silos``, shared with the strategy and its method) and the nodes
    whose silo cannot start (``failed``, by node id).

    ``experiment``: the run (its topology bounds how many silos can come, its round timeout
    bounds a query); ``method_name`` and ``method_needs``: for messages and the fewest silos
    the method can run with."""

    def __init__(self, experiment: ExperimentConfig, silos: dict[int, SiloInfo],
                 method_name: str, method_needs: int) -> None:
        self.experiment = experiment
        self.silos = silos
        self.failed: dict[int, FailedNode] = {}
        self.name = method_name
        self.needs = method_needs
        self._noise_checked: set[int] = set()  # silos whose z was compared with the others'
        #: partitions of the checkpoint a resumed run continues: what they spent is this run's
        self.resuming: set[int] = set()

    def silos_needed(self) -> int:
        return self.needs

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
            answered = all(n in self._known_nodes() or self._cannot_run(n) for n in present)
            if (len(self.silos) >= target or time.monotonic() >= deadline
                    or (answered and len(present) >= target)):
                break
            pause(0.5)
        if len(self.silos) < needed:
            raise TooFewSilos(self._too_few(present, expected, needed, wait))
        if len(self.silos) < expected:
            logger.warning("%s; going on with them", self._silo_count(present, expected, wait))

    def _silo_count(self, present: list[int], expected: int, wait: float) -> str:
        """'3 of 21 silos can run (18 failed to start: <reason> (nodes ...))', one line."""
        known = self._known_nodes()
        by_reason: dict[str, list[int]] = {}
        for node in present:
            if node not in known and self._cannot_run(node):
                by_reason.setdefault(self.failed[node].reason, []).append(node)
        failed = sum(len(nodes) for nodes in by_reason.values())
        silent = len([n for n in present if n not in known and not self._cannot_run(n)])
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

    def _cannot_run(self, node: int) -> bool:
        """Whether ``node``'s silo itself answered that it cannot start."""
        return node in self.failed and self.failed[node].answered

    def refresh_silos(self, grid: Grid) -> list[int]:
        """Query the nodes the server has not heard from (new silos, or restarted ones), again
        every :data:`RETRY_FAILED_SECONDS` the nodes whose silo could not start, and every
        :data:`RETRY_UNREACHABLE_SECONDS` those the SuperLink answered for; returns
        the ids of the nodes present."""
        present = list(grid.get_node_ids())
        for gone in set(self.failed) - set(present):
            del self.failed[gone]
        known = self._known_nodes()
        now = time.monotonic()
        ask = [n for n in present if n not in known and (
            n not in self.failed or self.failed[n].due(now))]
        if not ask:
            return present
        messages = {node: Message(RecordDict({CONFIG: ConfigRecord({"server-round": 0})}),
                                  dst_node_id=node, message_type="query") for node in ask}
        result = exchange(grid, messages, timeout=min(self.experiment.round_timeout, 600.0))
        for node, message in result.replies.items():
            if message.has_error():
                reason = message.error.reason or f"error code {message.error.code}"
                if message.error.code in NOT_ANSWERED:
                    self._unreachable(node, reason, now)
                else:
                    self._cannot_start(node, reason, now)
                continue
            try:
                _, fields = reply_numbers(message, SILO_FIELDS, SILO)
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
        reason = _one_line(reason)
        previous = self.failed.get(node)
        self.failed[node] = FailedNode(reason, asked)
        if previous is None or previous.reason != reason:
            logger.error("silo on node %d cannot start: %s", node, reason)

    def _unreachable(self, node: int, reason: str, asked: float) -> None:
        """Remember that the SuperLink answered for ``node`` (offline, or its session ended)
        and ask it again soon; said once per node, at info level: a reconnecting silo is
        expected to do this."""
        reason = _one_line(reason)
        if node not in self.failed or self.failed[node].answered:
            logger.info("node %d did not answer (%s); asking it again in %g s", node, reason,
                        RETRY_UNREACHABLE_SECONDS)
        self.failed[node] = FailedNode(reason, asked, answered=False)

    def adopt(self, restored: dict[int, SiloInfo]) -> None:
        """A resumed run's silos (``restored``, by partition, from its checkpoint): one that
        has rejoined keeps its history (rounds dropped or refused, last evaluation, noise,
        budget state, the learning rate it chose) under its new node id; one that has not
        stays in the run's results, on no node until it rejoins (:meth:`refresh_silos`)."""
        for partition, before in restored.items():
            now = self.silos.get(partition)
            if now is None:
                before.node_id = -1
                self.silos[partition] = before
                continue
            now.dropped_rounds, now.refused_rounds = before.dropped_rounds, before.refused_rounds
            now.test_accuracy, now.test_loss = before.test_accuracy, before.test_loss
            now.test_balanced_accuracy = before.test_balanced_accuracy
            now.test_auroc, now.majority_class = before.test_auroc, before.majority_class
            now.noise_multiplier, now.exhausted = before.noise_multiplier, before.exhausted
            now.epsilon_spent_before = before.epsilon_spent_before
            # its private choice: asked again, it would train and be charged for it twice
            now.learning_rate = before.learning_rate

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
        if partition in self.resuming:
            logger.info("silo %d is back for the resumed run (eps %.4g of %g spent so far)",
                        partition, spent, budget)
        elif spent > 0:
            logger.warning("silo %d starts with eps %.4g of %g already spent (earlier runs): "
                           "this run can use the %.4g left, with larger noise", partition,
                           spent, budget, max(budget - spent, 0.0))

    def check_noise_multipliers(self, server_round: int, replied: list[int]) -> None:
        """Log, once per silo, a silo whose noise multiplier z differs from the one most silos
        with its budget, batch size and record count use: it calibrated for a smaller budget
        (spent in an earlier run), so its updates are noisier than theirs. Silos that differ
        on purpose (heterogeneous budgets, docs/heterogeneous-silos.md) are not compared."""
        new = [p for p in replied if p not in self._noise_checked]
        self._noise_checked.update(new)
        peers: dict[tuple[float, int | None, int], Counter[float]] = {}
        for silo in self.silos.values():
            if silo.noise_multiplier is not None:
                peers.setdefault(_kind(silo), Counter())[round(silo.noise_multiplier, 4)] += 1
        for partition in new:
            silo = self.silos[partition]
            counts = peers.get(_kind(silo), Counter())
            if silo.noise_multiplier is None or len(counts) < 2:
                continue
            usual = max(counts, key=lambda z: (counts[z], -z))
            mine = round(silo.noise_multiplier, 4)
            if mine != usual:
                logger.warning(
                    "round %d: silo %d trains with noise multiplier z=%.4g, %d other silo(s) "
                    "with %.4g (its budget eps %g, %.4g spent before this run; %d training "
                    "records)", server_round, partition, mine, counts[usual], usual,
                    silo.epsilon_budget, silo.epsilon_spent_before, silo.num_train)

    def note_error(self, server_round: int, silo: SiloInfo, message: Message,
                   refused: list[int]) -> None:
        reason = message.error.reason
        if message.error.code == BUDGET_EXCEEDED:
            silo.exhausted = True
            silo.refused_rounds.append(server_round)
            refused.append(silo.partition)
            logger.warning("round %d: silo %d refused: %s", server_round, silo.partition, reason)
        elif message.error.code == ROUND_REPEATED:  # a resumed run: dropped for this round
            silo.dropped_rounds.append(server_round)
            logger.warning("round %d: silo %d skipped: %s", server_round, silo.partition, reason)
        else:
            silo.dropped_rounds.append(server_round)
            logger.error("round %d: silo %d failed (code %d): %s", server_round, silo.partition,
                         message.error.code, reason)


def _kind(silo: SiloInfo) -> tuple[float, int | None, int]:
    """What a silo's noise multiplier should depend on: its budget, batch and record count."""
    return silo.epsilon_budget, silo.batch_size, silo.num_train
