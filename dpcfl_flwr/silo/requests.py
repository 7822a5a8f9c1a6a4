"""What a silo accepts from the server: every field of a ``train`` or ``evaluate`` message,
validated before anything is computed, charged or released.

The server is not trusted (docs/threat-model.md): a field it sends may be missing, of the wrong
type, NaN, zero or absurd. A bad field is refused with :class:`BadRequest`, whose one-line
message names it; the ClientApp answers with an Error (:data:`~.protocol.BAD_REQUEST`) and
charges nothing. The field layout itself is documented in :mod:`.protocol`.
"""

from __future__ import annotations

from typing import Any, Literal

from flwr.app import Message
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config.validation import ConfigError, ConfigModel, one_line_error
from ..data.schema import parse_floats
from ..privacy.defaults import UNNAMED_ACCOUNTANT, AccountantName, BudgetMode, Conversion
from ..privacy.schedule import MAX_TUNED_RATES, Schedule, check_candidates
from ..protocol import CONFIG, MAJORITY

#: Caps that keep a request from tying a silo up for days; any real schedule is far below.
MAX_ROUNDS = 100_000
MAX_LOCAL_EPOCHS = 1_000


class BadRequest(ConfigError):
    """A message field the silo will not act on; the message names the field."""


def _batch(value: Any) -> str:
    text = str(value)
    if text != "full" and not (text.isdigit() and int(text) > 0):
        raise ValueError("must be 'full' or a positive integer")
    return text


class _Request(ConfigModel):
    # Models travel as bytes fields of the same record: other keys are not read, so not refused.
    model_config = ConfigDict(extra="ignore", alias_generator=ConfigModel.model_config[
        "alias_generator"], populate_by_name=True, frozen=True, allow_inf_nan=False)


class TrainRequest(_Request):
    """The settings of a ``train`` message (the models are read separately)."""

    server_round: int = Field(ge=1, le=MAX_ROUNDS)
    cluster: int = Field(ge=MAJORITY)
    round_batch: str
    learning_rate: float = Field(gt=0.0)
    clip_norm: float = Field(gt=0.0)
    personal: int = Field(0, ge=0, le=1)
    prox_lambda: float = Field(0.0, ge=0.0)
    prox_variant: Literal["correct", "authors"] = "correct"
    # what the silo keys its noise plan by (the same across a resumed run's Flower runs); 0:
    # the Flower run id. Only which stored plan applies: spending is bounded by the ledger.
    run_key: int = Field(0, ge=0, lt=2**63)
    # the whole schedule the silo calibrates its noise for (dpcfl_flwr.silo.silo.Schedule)
    rounds: int = Field(ge=1, le=MAX_ROUNDS)
    local_epochs: int = Field(ge=1, le=MAX_LOCAL_EPOCHS)
    batch_size: int = Field(ge=1)
    first_batch: str
    select_rounds: int = Field(ge=0, le=MAX_ROUNDS)
    select_ratio: float = Field(ge=0.0, lt=1.0)
    conversion: Conversion
    budget_mode: BudgetMode
    evaluations: int = Field(0, ge=0, le=MAX_ROUNDS)
    # calibrate for this smaller epsilon if it is below the silo's budget (0: the budget)
    epsilon_target: float = Field(0.0, ge=0.0)
    # the accountant the server proposes (absent: rdp, what every message meant before there
    # was a choice); the silo's own choice rules (config.SiloConfig.accountant)
    accountant: AccountantName = UNNAMED_ACCOUNTANT
    # how the run expects the silo to privatise; the silo refuses one that is not its own
    privatiser: Literal["dpsgd", "dprivacy"] = "dpsgd"
    # the schedule's learning-rate choice: how many candidates its plan holds (0: none), and,
    # in the round that chooses, the candidates (docs/algorithm.md#choosing-the-learning-rate)
    tune_candidates: int = Field(0, ge=0, le=MAX_TUNED_RATES)
    learning_rate_candidates: str = ""

    @field_validator("round_batch", "first_batch", mode="before")
    @classmethod
    def _valid_batch(cls, value: Any) -> str:
        return _batch(value)

    @model_validator(mode="after")
    def _contracting_prox(self) -> TrainRequest:
        # MR-MTL's step moves theta - anchor to (1 - lr lambda)(theta - anchor) - lr g: with
        # lr lambda >= 2 that factor is <= -1, so the distance never shrinks and (above 2)
        # grows every step: a round that must end in overflow, not one worth a charge
        largest = max((self.learning_rate, *self.candidate_rates))
        if largest * self.prox_lambda >= 2.0:
            raise ValueError(f"'learning-rate' x 'prox-lambda' = "
                             f"{largest * self.prox_lambda:g} must stay below 2, "
                             "else the proximal step diverges")
        return self

    @field_validator("learning_rate_candidates")
    @classmethod
    def _valid_candidates(cls, value: str) -> str:
        check_candidates(parse_floats(value))
        return value

    @model_validator(mode="after")
    def _planned_choice(self) -> TrainRequest:
        # a round that chooses trains as many models as its candidates: the plan must hold
        # that many, or the silo would train more than its noise was calibrated for
        if self.candidate_rates and len(self.candidate_rates) != self.tune_candidates:
            raise ValueError(f"{len(self.candidate_rates)} 'learning-rate-candidates' where "
                             f"the schedule's 'tune-candidates' plans {self.tune_candidates}")
        return self

    @property
    def candidate_rates(self) -> tuple[float, ...]:
        """The learning rates this round chooses among (empty: it trains at learning-rate)."""
        return parse_floats(self.learning_rate_candidates)

    @property
    def batch(self) -> int | Literal["full"]:
        return "full" if self.round_batch == "full" else int(self.round_batch)

    @property
    def schedule(self) -> Schedule:
        """The whole DP schedule the message proposes (the silo calibrates its noise for it)."""
        first = self.first_batch
        return Schedule(self.rounds, self.local_epochs, self.batch_size,
                        "full" if first == "full" else int(first), self.select_rounds,
                        self.select_ratio, self.conversion, self.budget_mode, self.evaluations,
                        self.epsilon_target, self.accountant, self.tune_candidates)


class EvaluateRequest(_Request):
    """The settings of an ``evaluate`` message."""

    server_round: int = Field(ge=0, le=MAX_ROUNDS)
    cluster: int = Field(ge=MAJORITY)


def parse_request(kind: type[_Request], message: Message) -> Any:
    """The ``config`` record of ``message`` validated as ``kind``; :class:`BadRequest` naming
    the first missing or bad field."""
    what = f"{message.metadata.message_type} message"
    record = message.content.config_records.get(CONFIG)
    if record is None:
        raise BadRequest(f"{what}: no '{CONFIG}' record")
    try:
        return kind.model_validate({k: v for k, v in record.items()
                                    if not isinstance(v, bytes)})
    except ValidationError as exc:
        raise BadRequest(str(one_line_error(exc, what, kind))) from None
