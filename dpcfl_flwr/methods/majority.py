"""Majority class (docs/algorithm.md#majority): the floor every comparison table shows.

No silo trains or sends an update. Each predicts one class for every record: its training
split's most common label, chosen privately by the exponential mechanism over its label
counts (sensitivity 1) at eps_select = ``select-ratio`` x its budget, one selection charged
to its ledger (docs/privacy.md#exponential-mechanism-selections). It is evaluated like any
model, exact or through the private metrics. A method that beats accuracy but not this
baseline's balanced accuracy learnt the label skew, not the task.

The server sends each silo one majority round (``cluster`` = MAJORITY, no weights) until the
silo has answered it; the silo keeps its class for the run, so a repeated message costs
nothing (dpcfl_flwr/silo/majority.py).
"""

from __future__ import annotations

from pydantic import Field

from ..config.registry import register
from ..config.settings import ExperimentConfig
from ..privacy.schedule import Schedule
from ..protocol import MAJORITY
from .base import Method, MethodParams, ServerState, TrainReply


class MajorityParams(MethodParams):
    """``[majority]``: the share of a silo's budget its private choice of class costs."""

    select_ratio: float = Field(0.05, gt=0.0, lt=1.0,
                                description="eps_select / eps of the one selection")


@register
class Majority(Method):
    name = "majority"
    title = "Majority class: each silo predicts its most common training label, chosen privately"
    Params = MajorityParams
    params: MajorityParams
    personal = True  # no model on the server, no update from a silo
    weighs_updates = False

    def __init__(self, experiment: ExperimentConfig, params: MajorityParams,
                 state: ServerState) -> None:
        super().__init__(experiment, params, state)
        #: the silos that answered their majority round (their class is kept for the run)
        self.chosen: set[int] = set()

    def schedule(self) -> Schedule:
        """No DP-SGD: one selection at ``select-ratio`` of the budget (the silo plans no z)."""
        e = self.experiment
        return Schedule(e.num_server_rounds, e.local_epochs, e.batch_size, e.batch_size, 1,
                        self.params.select_ratio, e.conversion, e.budget_mode)

    def chooses_learning_rate(self) -> bool:
        """No: nothing is trained, so there is no learning rate to spend budget on."""
        return False

    def stage(self, server_round: int) -> str:
        return "majority"

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        return {p: MAJORITY for p in partitions if p not in self.chosen}

    def absorb(self, server_round: int, replies: dict[int, TrainReply]) -> None:
        self.chosen.update(p for p, reply in replies.items() if reply.cluster == MAJORITY)

    def current_cluster(self, partition: int) -> int:
        return MAJORITY
