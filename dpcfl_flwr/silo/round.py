"""A silo's round, from a validated request to what its reply carries: one call per message
kind, so the ClientApp only parses, calls and replies.

Before any work, calibration or charge, a train round is accepted whole: the privatiser it
asks for is the silo's own, its DP-SGD steps are within the silo's limit, and every model it
uses (the one to train, a selection's candidates, MR-MTL's anchor) is this silo's model with
finite weights (docs/threat-model.md#work-per-message). Then the silo's privatiser checks the
budget, trains, privatises and charges, all under the ledger's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..protocol import ANCHOR, MAJORITY, SELECT, WireModel, evaluation_fields
from .euclidean_laplace import EuclideanLaplace
from .gaussian import GaussianDPSGD
from .kept_model import evaluated_metadata, keep_evaluated_model
from .majority import majority_model, majority_round
from .privatiser import Privatiser, RoundOutcome, RoundWork
from .received import received_model, selection_candidates, start_model
from .requests import BadRequest, EvaluateRequest, TrainRequest
from .silo import Silo

#: The built-in privatisers by the name a silo's node config gives (``privatiser``).
PRIVATISERS: dict[str, Privatiser] = {p.name: p for p in (GaussianDPSGD(), EuclideanLaplace())}


def train_round(silo: Silo, request: TrainRequest, models: Mapping[str, WireModel]
                ) -> RoundOutcome:
    """Accept, then run one train round through the silo's privatiser; ``models``: the
    message's models by name, plus ``own-model`` when the silo keeps one (Local)."""
    own = silo.silo.privatiser or "dpsgd"
    if request.privatiser != own:  # a DP-SGD silo never releases a plainly trained model
        raise BadRequest(f"train message: 'privatiser' = {request.privatiser!r}, but this "
                         f"silo privatises with {own!r} (its own node config)")
    if request.cluster == MAJORITY:  # nothing to train: a private choice of one class
        return majority_round(silo, request)
    privatiser = PRIVATISERS[own]
    proposed = request.schedule
    schedule = silo.own_schedule(proposed)
    batch = silo.own_batch(request.batch, proposed)
    silo.check_work(schedule, batch)
    selecting = request.cluster == SELECT
    privatiser.check(request, selecting)
    candidates = (selection_candidates(models, silo) if selecting
                  else [start_model(models, silo)])
    anchor = (received_model(models, ANCHOR, silo)
              if ANCHOR in models and request.prox_variant == "correct" else None)
    work = RoundWork(schedule, batch, candidates, anchor, selecting)
    with silo.charging():  # check, train and charge under the ledger's lock
        silo.refuse_repeat(request.run_key, "train", request.server_round)
        outcome = privatiser.run(silo, request, work)
        silo.note_charged(request.run_key, "train", request.server_round)
        return outcome


def evaluate_round(silo: Silo, request: EvaluateRequest, models: Mapping[str, WireModel],
                   planned_rounds: int | None, run_name: int) -> dict[str, Any]:
    """Test the model the message names (charged with private metrics), keep the silo's own
    copy of it (:mod:`.kept_model`), and return the reply's numbers
    (docs/protocol.md#evaluate). ``planned_rounds``: the run's ``rounds`` from its first
    answered train message (None before), which tells the final evaluation; ``run_name``:
    what the silo names the run's files by. A majority-class silo tests the class it chose
    (:mod:`.majority`) and keeps no model file: its class is in its ledger."""
    model: torch.nn.Module
    if request.cluster == MAJORITY:
        state, model = None, majority_model(silo, silo.run_name(run_name))
    else:
        state = start_model(models, silo)
        model = silo.new_model(state)
    with silo.charging():  # a private evaluation is charged like a round
        cost = silo.evaluation_cost(request.server_round)
        if cost:
            silo.refuse_repeat(run_name, "evaluate", request.server_round)
        silo.check(list(cost), request.server_round)
        reported, exact = silo.test(model, request.server_round)
        if cost:
            silo.note_charged(run_name, "evaluate", request.server_round)
    metrics = evaluation_fields(reported)
    if state is not None:  # the silo's own copy of the model it would use; nothing of it leaves
        keep_evaluated_model(silo, state, evaluated_metadata(
            silo, request.server_round, request.cluster, planned_rounds, metrics,
            evaluation_fields(exact)), run_name)
    metrics.update({"cluster": request.cluster, "epsilon-spent": silo.spent()})
    return metrics
