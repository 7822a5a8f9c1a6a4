"""Per-round metrics as TensorBoard event files, to watch a run as it goes.

``<out-dir>/tensorboard/`` holds them, written by PyTorch's
:class:`~torch.utils.tensorboard.SummaryWriter` (TensorBoard's own format and library) and
flushed after every round, so ``tensorboard --logdir <out-dir>`` shows a running run. The
step of every scalar is the round number. Tags (docs/experiments.md#watching-a-run-in-tensorboard):

``accuracy/test-mean``         mean test accuracy of the silos evaluated (evaluation rounds)
``accuracy/test-minority``     the same over the minority cluster's silos, when there is one
``accuracy/test-balanced-mean`` mean balanced accuracy of the silos evaluated (evaluation rounds)
``accuracy/test-auroc-mean``   mean AUROC of the silos evaluated (two classes only)
``accuracy/validation-mean``   mean validation accuracy the trainers reported, when known
``privacy/max-epsilon-spent``  the largest epsilon any silo has spent so far
``round/seconds``              the round's training exchange, wall time
``round/server-seconds``       the server's own work on the replies
``round/trained-silos``, ``round/dropped-silos``, ``round/refused-silos``  silo counts
``clusters/<m>/silos``         silos that trained cluster m's model this round
``silo/<p>/test-accuracy``     silo p's test accuracy (evaluation rounds)
``silo/<p>/test-balanced-accuracy``, ``silo/<p>/test-auroc``  the same figures of silo p
``silo/<p>/epsilon-spent``     silo p's spend after the round
``silo/<p>/learning-rate``     the learning rate silo p chose, once it has

The values are the ones ``results.json`` records for the round (``rounds``; the spend per silo
is its last known figure). A resumed run opens its writer with ``purge_step`` = the first round
it runs: TensorBoard's reader drops what the killed run wrote from that round on, so each
round shows once. The writer is told before the results writer (:class:`Observers`), so a
round in the event files but not in the checkpoint is always one a resumed run rewrites.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.settings import ExperimentConfig
from .recorder import minority_cluster

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ..strategies import ClusteredStrategy, RoundReport, RunObserver

#: The event files' folder inside a results directory.
BOARD_DIR = "tensorboard"


class BoardWriter:
    """A :class:`~dpcfl_flwr.strategies.RunObserver` that writes each round's scalars to
    TensorBoard event files in ``folder``. ``after_round``: the last round a resumed run's
    checkpoint holds (0 for a new run); what was written after it is purged."""

    def __init__(self, folder: str | Path, after_round: int = 0) -> None:
        self.folder = Path(folder)
        self.after_round = after_round
        self._writer: SummaryWriter | None = None

    @classmethod
    def of_run(cls, experiment: ExperimentConfig, after_round: int = 0) -> BoardWriter | None:
        """The writer of ``experiment``'s results directory; None with ``tensorboard = false``."""
        if not experiment.tensorboard:
            return None
        return cls(Path(experiment.out_dir) / BOARD_DIR, after_round)

    def silos_known(self, strategy: ClusteredStrategy) -> None:
        """Nothing to write yet: the event file opens with the first round, so a resumed run
        with no round left to run adds none."""

    def round_done(self, strategy: ClusteredStrategy, report: RoundReport) -> None:
        self.write(report.round, round_scalars(strategy, report))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """``scalars`` by tag at ``step``, on disk when this returns (a user watches live)."""
        writer = self._open()
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        writer.flush()
        self.after_round = max(self.after_round, step)  # a reopened writer purges from here

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            # Imported here: it loads tensorboard, which a run with tensorboard = false skips.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder), purge_step=self.after_round + 1)
        return self._writer


class Observers:
    """Several run observers as one, each told in the order given."""

    def __init__(self, *observers: RunObserver) -> None:
        self.observers = observers

    @classmethod
    def of(cls, *observers: RunObserver | None) -> RunObserver:
        """The observers that are not None; one alone is returned as it is."""
        present = [o for o in observers if o is not None]
        return present[0] if len(present) == 1 else cls(*present)

    def silos_known(self, strategy: ClusteredStrategy) -> None:
        for observer in self.observers:
            observer.silos_known(strategy)

    def round_done(self, strategy: ClusteredStrategy, report: RoundReport) -> None:
        for observer in self.observers:
            observer.round_done(strategy, report)


def round_scalars(strategy: ClusteredStrategy, report: RoundReport) -> dict[str, float]:
    """The round's scalars by tag (the module docstring lists them); unknown values left out."""
    truth = {p: s.true_cluster for p, s in strategy.silos.items()}
    minority = minority_cluster(truth)
    tested = report.test_accuracy or {}
    spent = {p: s.epsilon_spent for p, s in strategy.silos.items()}
    scalars: dict[str, Any] = {
        "accuracy/test-mean": _mean(tested.values()),
        "accuracy/test-minority": _mean(a for p, a in tested.items() if truth[p] == minority),
        "accuracy/test-balanced-mean": _mean(report.test_balanced_accuracy.values()),
        "accuracy/test-auroc-mean": _mean(report.test_auroc.values()),
        "accuracy/validation-mean": _mean(report.val_accuracy.values()),
        "privacy/max-epsilon-spent": max(spent.values(), default=None),
        "round/seconds": report.seconds,
        "round/server-seconds": report.server_seconds,
        "round/trained-silos": len(report.trained),
        "round/dropped-silos": len(report.dropped),
        "round/refused-silos": len(report.refused),
    }
    for cluster, size in enumerate(report.cluster_sizes(strategy.n_clusters)):
        scalars[f"clusters/{cluster}/silos"] = size
    for partition, accuracy in sorted(tested.items()):
        scalars[f"silo/{partition}/test-accuracy"] = accuracy
    for partition, balanced in sorted(report.test_balanced_accuracy.items()):
        scalars[f"silo/{partition}/test-balanced-accuracy"] = balanced
    for partition, area in sorted(report.test_auroc.items()):
        scalars[f"silo/{partition}/test-auroc"] = area
    for partition, epsilon in sorted(spent.items()):
        scalars[f"silo/{partition}/epsilon-spent"] = epsilon
    for partition, silo in sorted(strategy.silos.items()):
        scalars[f"silo/{partition}/learning-rate"] = silo.learning_rate
    return {tag: float(v) for tag, v in scalars.items() if _known(v)}


def event_files(results_dir: str | Path) -> list[Path]:
    """The TensorBoard event files of a results directory (none for a run before them, or
    with ``tensorboard = false``)."""
    return sorted((Path(results_dir) / BOARD_DIR).glob("events.out.tfevents.*"))


def _mean(values: Any) -> float | None:
    known = [float(v) for v in values if _known(v)]
    return sum(known) / len(known) if known else None


def _known(value: Any) -> bool:
    """A number to plot: not None, not NaN or infinite (private metrics may be unknown)."""
    return value is not None and math.isfinite(float(value))
