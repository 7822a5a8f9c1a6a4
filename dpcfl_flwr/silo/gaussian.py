"""DP-SGD as a silo's privatiser: (epsilon, delta)-DP for every record against the server.

The silo calibrates its noise multiplier z for the whole schedule once per run
(:meth:`~.silo.Silo.plan`), checks that the round (and a selection) fits its budget, picks a
cluster privately in a selection round (exponential mechanism on train accuracy,
docs/algorithm.md#stage-3-private-cluster-selection), and trains with DP-SGD; MR-MTL's
proximal term, anchored at the model the server sent as ``anchor``, is added after the noise
(post-processing, docs/privacy.md#what-costs-privacy). In the round that chooses the
learning rate it trains one model per candidate from the same start and releases the one
the exponential mechanism picks on train accuracy, every model's steps and the selection
charged (docs/algorithm.md#choosing-the-learning-rate).
"""

from __future__ import annotations

from ..dpsgd.training import DPSGDConfig
from ..privacy.ledger import GaussianSteps, Selection
from .privatiser import Privatiser, RoundOutcome, RoundWork
from .requests import BadRequest, TrainRequest
from .silo import Silo, SiloPlan


class GaussianDPSGD(Privatiser):
    """Poisson-subsampled Gaussian DP-SGD (docs/privacy.md)."""

    name = "dpsgd"

    def check(self, request: TrainRequest, selecting: bool) -> None:
        if selecting and request.select_ratio <= 0:
            raise BadRequest("train message: a selection round (cluster = -1) needs "
                             "'select-ratio' > 0, the budget share of its private selection")
        if request.candidate_rates and request.select_ratio <= 0:
            raise BadRequest("train message: 'learning-rate-candidates' needs "
                             "'select-ratio' > 0, the budget share of the private choice")

    def run(self, silo: Silo, request: TrainRequest, work: RoundWork) -> RoundOutcome:
        plan = silo.plan(work.schedule, request.run_key)
        server_round, cluster = request.server_round, request.cluster
        cost = silo.round_cost(plan, work.batch, server_round, work.schedule.local_epochs)
        rates = request.candidate_rates or (request.learning_rate,)
        planned: list[GaussianSteps | Selection] = [cost] * len(rates)
        selections = int(work.selecting) + int(len(rates) > 1)
        if selections:  # (a schedule without selections has epsilon_select 0)
            planned += [Selection(plan.epsilon_select, round=server_round)] * selections
        silo.check(planned, server_round)
        if work.selecting:
            cluster = silo.select(work.candidates, plan, server_round)
        start = work.candidates[cluster if work.selecting else 0]
        prox = None if work.anchor is None else (request.prox_lambda, work.anchor)
        trained = [silo.train(start, self._config(silo, plan, request, work, rate),
                              server_round, prox) for rate in rates]
        chosen = 0 if len(rates) == 1 else silo.select(
            [{k: start[k] + update[k] for k in start} for update, _ in trained], plan,
            server_round)
        update, metrics = trained[chosen]
        # z, b and the steps let the server (and an evaluation-only oracle) size the noise
        metrics.update({"cluster": cluster, "selected": int(work.selecting),
                        "noise-multiplier": plan.noise_multiplier,
                        "batch-size": silo.data.num_train if work.batch == "full"
                        else work.batch, "steps": cost.steps, "learning-rate": rates[chosen]})
        return RoundOutcome(update, start, metrics)

    @staticmethod
    def _config(silo: Silo, plan: SiloPlan, request: TrainRequest, work: RoundWork,
                learning_rate: float) -> DPSGDConfig:
        return DPSGDConfig(plan.noise_multiplier, request.clip_norm, learning_rate, work.batch,
                           work.schedule.local_epochs,
                           silo.experiment.physical_batch_size or None)
