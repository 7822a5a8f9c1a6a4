"""A silo's round under d-privacy (paper 004, Alg. 1 and 2; docs/dprivacy.md).

The silo picks, of the hypotheses it received, the one of lowest loss on its own training
records (a choice paper 004 does not protect: the released model sits near the hypothesis it
came from), trains it with plain SGD, and releases the trained model through the Euclidean
Laplace mechanism calibrated by its own noise multiplier v: epsilon = n / (v ||update||), so
the expected noise norm is v ||update||. Every release costs n / v of d-privacy leakage, which
its ledger keeps apart from (epsilon, delta)-DP and bounds by its own leakage budget, checked
before anything is trained or released. v and the budget are the silo's (node config); the
server cannot change them.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..dpsgd.training import evaluation_sums, train_sgd
from ..privacy.dprivacy import sanitize_update
from ..privacy.ledger import DPrivacyRelease
from ..privacy.metrics import LOSS_BOUND
from .privatiser import Privatiser, RoundOutcome, RoundWork
from .requests import BadRequest, TrainRequest
from .silo import BudgetExceeded, Silo

logger = logging.getLogger(__name__)


def model_size(state: dict[str, torch.Tensor]) -> int:
    """n, the dimension of the released vector (every floating tensor of the model)."""
    return sum(t.numel() for t in state.values() if t.is_floating_point())


def planned_leakage(silo: Silo, n: int) -> float:
    """What one release costs in the paper's units: n / v (inf without noise, v = 0)."""
    v = float(silo.silo.dprivacy_noise or 0.0)
    return n / v if v > 0 else math.inf


def check_leakage(silo: Silo, leakage: float, round_number: int) -> None:
    """Refuse a round whose release would take the silo's leakage past its budget (0: no
    budget, then only logged)."""
    budget = float(silo.silo.dprivacy_leakage_budget or 0.0)
    so_far = silo.ledger.dprivacy_leakage()
    if budget > 0 and so_far + leakage > budget:
        raise BudgetExceeded(
            f"silo {silo.silo.partition_id} refuses round {round_number}: its d-privacy "
            f"leakage would reach {so_far + leakage:.4g} > its budget {budget:g} (n/v = "
            f"{leakage:.4g} per release)")


def best_fit(silo: Silo, candidates: list[dict[str, torch.Tensor]]) -> int:
    """The hypothesis of lowest loss on the silo's training records (paper 004, Alg. 1), each
    record's loss bounded (:func:`~.training.bounded_losses`): a record on which the server's
    weights overflow cannot make a sum NaN and steer the choice by itself."""
    losses = [evaluation_sums(silo.new_model(state), silo.data.x_train, silo.data.y_train,
                              LOSS_BOUND)[0] for state in candidates]
    return int(np.argmin(losses))


def _flat(state: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).double() for t in state.values()]).numpy()


def _unflat(vector: np.ndarray, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, tensor in like.items():
        size = tensor.numel()
        out[key] = torch.from_numpy(vector[offset:offset + size].copy()).reshape(
            tensor.shape).to(tensor.dtype)
        offset += size
    return out


class EuclideanLaplace(Privatiser):
    """d-privacy's sanitised model (paper 004, Alg. 1 and 2; docs/dprivacy.md)."""

    name = "dprivacy"

    def check(self, request: TrainRequest, selecting: bool) -> None:
        """The choice among hypotheses is by loss and costs no budget share (paper 004 leaves
        it unprotected); a learning-rate choice, whose selection would need one, is refused:
        a d-privacy run sets its learning rate."""
        if request.candidate_rates:
            raise BadRequest("train message: 'learning-rate-candidates' is for DP-SGD silos; "
                             "a d-privacy run sets its learning rate")

    def run(self, silo: Silo, request: TrainRequest, work: RoundWork) -> RoundOutcome:
        """Check the leakage budget, choose (of several hypotheses, the best fit), train with
        plain SGD, sanitise and charge one round."""
        candidates, cluster = work.candidates, request.cluster
        n = model_size(candidates[0])
        leakage = planned_leakage(silo, n)
        check_leakage(silo, leakage, request.server_round)
        if len(candidates) > 1:
            cluster = best_fit(silo, candidates)
        start = candidates[0] if len(candidates) == 1 else candidates[cluster]
        model = silo.new_model(start)
        seed = silo.charge_seed()
        train_sgd(model, silo.data.x_train, silo.data.y_train, request.learning_rate,
                  silo.data.num_train if work.batch == "full" else work.batch,
                  work.schedule.local_epochs, seed)
        trained, received = _flat(model.state_dict()), _flat(start)
        # Finite per-record gradients can still overflow in the sum of many steps; the
        # release is then the received model there, never a NaN the mechanism cannot noise.
        trained = np.where(np.isfinite(trained), trained, received)
        if math.isfinite(leakage):
            sanitized = sanitize_update(trained, received,
                                        float(silo.silo.dprivacy_noise or 0.0),
                                        np.random.default_rng(seed))
            silo.charge([DPrivacyRelease(sanitized.epsilon, sanitized.leakage,
                                         round=request.server_round)])
            released = sanitized.released
        else:
            logger.warning("silo %d releases its trained model without noise (v = 0): no "
                           "d-privacy guarantee", silo.silo.partition_id)
            released = trained
        metrics = {"num-examples": silo.data.num_train, "cluster": cluster, "selected": 0,
                   "noise-multiplier": 0.0,
                   "dprivacy-noise": float(silo.silo.dprivacy_noise or 0),
                   "dprivacy-leakage": silo.ledger.dprivacy_leakage()}
        return RoundOutcome(_unflat(released - received, start), start, metrics)
