"""A silo's side of the majority-class baseline (docs/algorithm.md#majority): it trains
nothing and predicts one class for every record, its training split's most common label,
chosen privately.

The choice is the exponential mechanism over the training label counts (report-noisy-max
with Gumbel noise, :func:`~..privacy.selection.select_cluster`): adding or removing one record
changes one class's count by 1 and no other, so the utility's sensitivity is 1, and the draw
is eps_select-DP, charged as one :class:`~..privacy.ledger.Selection` like R-DPCFL's
(docs/privacy.md#exponential-mechanism-selections). eps_select is the train message's
``select-ratio`` of what the run may spend (:meth:`~.silo.Silo.plan` with ``trains=False``).
The class chosen is kept in the silo's ledger under the run's key, so a later round or
evaluation of the run uses it again at no cost: it releases nothing new. It is evaluated
through the ordinary evaluation (exact, or private and charged), as a model whose logits are
the same for every record (:class:`MajorityClassifier`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ..privacy.ledger import Selection
from ..privacy.metrics import LOSS_BOUND
from ..privacy.selection import select_cluster
from ..protocol import MAJORITY
from .privatiser import RoundOutcome
from .requests import BadRequest, TrainRequest
from .silo import MAX_PLANS, Silo

logger = logging.getLogger(__name__)

#: The ledger's ``meta`` key of the classes chosen, by run.
KEPT = "majority"

#: Sensitivity of a label count to one record added or removed.
COUNT_SENSITIVITY = 1.0


class MajorityClassifier(nn.Module):
    """Predicts class ``label`` for every record: logit ``LOSS_BOUND`` on it, 0 on every other
    class, so its cross-entropy is about LOSS_BOUND nats on every record it gets wrong and
    about 0 on the others (a hard prediction whose loss stays finite), and with two classes
    every record has the same score (AUROC 0.5)."""

    logits: torch.Tensor

    def __init__(self, label: int, num_classes: int) -> None:
        super().__init__()
        logits = torch.zeros(num_classes)
        logits[label] = LOSS_BOUND
        self.register_buffer("logits", logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1)


def kept_class(silo: Silo, run_name: str) -> int | None:
    """The class the silo chose in the run ``run_name`` (its ledger's name of the run), or
    None before it chose."""
    label = silo.ledger.meta.get(KEPT, {}).get(run_name)
    return None if label is None else int(label)


def _keep_class(silo: Silo, run_name: str, label: int) -> None:
    kept = silo.ledger.meta.setdefault(KEPT, {})
    kept[run_name] = label
    for old in list(kept)[:max(0, len(kept) - MAX_PLANS)]:
        del kept[old]


def choose_class(label_counts: np.ndarray, epsilon: float,
                 rng: np.random.Generator | None = None) -> int:
    """The exponential mechanism over ``label_counts`` at ``epsilon`` (sensitivity 1): class
    k with probability proportional to exp(epsilon n_k / 2). ``rng``: tests only (None: OS
    entropy)."""
    return select_cluster(np.asarray(label_counts, dtype=np.float64).tolist(), epsilon,
                          COUNT_SENSITIVITY, rng)


def majority_round(silo: Silo, request: TrainRequest) -> RoundOutcome:
    """A train message with ``cluster`` = MAJORITY: choose the class privately (the run's
    first such message, charged) or answer with the one chosen before (free). Nothing is
    trained and no update leaves."""
    if request.select_ratio <= 0:
        raise BadRequest("train message: a majority round (cluster = -4) needs "
                         "'select-ratio' > 0, the budget share of its private choice")
    schedule = silo.own_schedule(request.schedule)
    run_name = silo.run_name(request.run_key)
    with silo.charging():  # check, choose and charge under the ledger's lock
        label = kept_class(silo, run_name)
        chosen = label is None
        if label is None:
            plan = silo.plan(schedule, request.run_key, trains=False)
            planned = [Selection(plan.epsilon_select, round=request.server_round)]
            silo.check(list(planned), request.server_round)
            counts = torch.bincount(silo.data.y_train,
                                    minlength=silo.experiment.num_classes).numpy()
            seed = silo.charge_seed()
            label = choose_class(counts, plan.epsilon_select,
                                 None if seed is None else np.random.default_rng(seed))
            silo.charge(planned)
            _keep_class(silo, run_name, label)
            silo.note_charged(request.run_key, "train", request.server_round)
            logger.info("silo %s predicts class %d (chosen at eps_select=%.4g)",
                        silo.silo.partition_id, label, plan.epsilon_select)
    metrics: dict[str, float] = {
        "num-examples": silo.data.num_train, "cluster": MAJORITY, "selected": int(chosen),
        "noise-multiplier": 0.0, "majority-class": label}
    return RoundOutcome(None, None, metrics)


def majority_model(silo: Silo, run_name: str) -> MajorityClassifier:
    """The classifier an evaluate message with ``cluster`` = MAJORITY tests; BadRequest when
    the silo has chosen no class in this run (no majority round reached it)."""
    label = kept_class(silo, run_name)
    if label is None:
        raise BadRequest("evaluate message: cluster = -4 (majority), but this silo chose no "
                         "class in this run (no majority train round reached it)")
    return MajorityClassifier(label, silo.experiment.num_classes)
