"""DP-SGD as a silo's privatiser: (epsilon, delta)-DP for every record against the server.

The silo calibrates its noise multiplier z for the whole schedule once per run
(:meth:`~.silo.Silo.plan`), checks that the round (and a selection) fits its budget, picks a
cluster privately in a selection round (exponential mechanism on train accuracy,
docs/algorithm.md#stage-3-private-cluster-selection), and trains with DP-SGD; MR-MTL's
proximal term, anchored at the model the server sent as ``anchor``, is added after the noise
(post-processing, docs/privacy.md#what-costs-privacy).
"""

from __future__ import annotations

from ..dpsgd.training import DPSGDConfig
from ..privacy.ledger import GaussianSteps, Selection
from .privatiser import Privatiser, RoundOutcome, RoundWork
from .requests import BadRequest, TrainRequest
from .silo import Silo


class GaussianDPSGD(Privatiser):
    """Poisson-subsampled Gaussian DP-SGD (docs/privacy.md)."""

    name = "dpsgd"

    def check(self, request: TrainRequest, selecting: bool) -> None:
        if selecting and request.select_ratio <= 0:
            raise BadRequest("train message: a selection round (cluster = -1) needs "
                             "'select-ratio' > 0, the budget share of its private selection")

    def run(self, silo: Silo, request: TrainRequest, work: RoundWork) -> RoundOutcome:
        plan = silo.plan(work.schedule, request.run_key)
        server_round, cluster = request.server_round, request.cluster
        cost = silo.round_cost(plan, work.batch, server_round, work.schedule.local_epochs)
        planned: list[GaussianSteps | Selection] = [cost]
        if work.selecting:
            planned.append(Selection(plan.epsilon_select, round=server_round))
        silo.check(planned, server_round)
        if work.selecting:
            cluster = silo.select(work.candidates, plan, server_round)
        start = work.candidates[cluster if work.selecting else 0]
        prox = None if work.anchor is None else (request.prox_lambda, work.anchor)
        dp = DPSGDConfig(plan.noise_multiplier, request.clip_norm, request.learning_rate,
                         work.batch, work.schedule.local_epochs,
                         silo.experiment.physical_batch_size or None)
        update, metrics = silo.train(start, dp, server_round, prox)
        # z, b and the steps let the server (and an evaluation-only oracle) size the noise
        metrics.update({"cluster": cluster, "selected": int(work.selecting),
                        "noise-multiplier": plan.noise_multiplier,
                        "batch-size": silo.data.num_train if work.batch == "full"
                        else work.batch, "steps": cost.steps})
        return RoundOutcome(update, start, metrics)
