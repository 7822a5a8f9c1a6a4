"""The ClientApp: a silo's ``query``, ``train`` and ``evaluate`` handlers (thin Flower glue).

Everything privacy-relevant happens in :mod:`dpcfl_flwr.silo.silo`. Every field of a message is
validated first (:mod:`dpcfl_flwr.silo.requests`; a bad one is answered with an Error carrying
:data:`~dpcfl_flwr.protocol.BAD_REQUEST`, nothing charged); the budget check, the work and the
charge run under the ledger's lock, and the ledger is on the silo's disk before a reply
leaves; a round that would overspend is answered with an Error carrying
:data:`~dpcfl_flwr.protocol.BUDGET_EXCEEDED` and the reason. Silo settings come from the node
config alone, except in Flower's simulation engine (:func:`running_in_simulation`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from .config.settings import ConfigError, parse_node_config, parse_run_config
from .data import DataError
from .dpsgd.training import DPSGDConfig
from .privacy import GaussianSteps, Selection
from .protocol import (
    ANCHOR,
    ARRAYS,
    BAD_REQUEST,
    BUDGET_EXCEEDED,
    CLUSTER_PREFIX,
    METRICS,
    OWN_MODEL,
    SELECT,
    SILO,
    SILO_FAILED,
    UPDATE,
    WireModel,
    cluster_key,
    metric_record,
    model_records,
    one_record,
    pack_state,
    reply,
    unpack_state,
)
from .silo.dprivacy import check_privatiser, released_round
from .silo.kept_model import evaluated_metadata, keep_evaluated_model
from .silo.requests import BadRequest, EvaluateRequest, TrainRequest, parse_request
from .silo.silo import BudgetExceeded, Schedule, Silo

logger = logging.getLogger(__name__)

app = ClientApp()

_STATE = "privacy"
#: The run's schedule as its first valid train message announced it (``rounds``): how the
#: silo tells the final evaluation, and so its final model (:mod:`.silo_model`), from others.
_RUN = "run-schedule"


def running_in_simulation() -> bool:
    """Whether this ClientApp runs inside Flower's simulation engine (a Ray actor), where one
    operator plays the server and every silo, so silo settings may come from the run config.
    A deployed SuperNode never runs its ClientApp in a Ray actor, whatever the server sends."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None


def _open_silo(context: Context) -> Silo:
    experiment = parse_run_config(context.run_config)
    silo = parse_node_config(context.node_config)
    record = context.state.config_records.get(_STATE)
    return Silo(silo, experiment, context.run_id,
                str(record["ledger"]) if record is not None else None,
                trust_run_config=running_in_simulation())


def _remember_rounds(context: Context, request: TrainRequest) -> None:
    """Keep the run's ``rounds`` from its first valid train message: the schedule the silo
    plans with, which a later message of the run cannot change (the plan refuses it)."""
    if _RUN not in context.state.config_records:
        context.state[_RUN] = ConfigRecord({"rounds": request.rounds,
                                            "run-key": request.run_key})


def _planned_rounds(context: Context) -> int | None:
    record = context.state.config_records.get(_RUN)
    return None if record is None else int(str(record["rounds"]))


def _run_name(context: Context) -> int:
    """What the silo names the run's files by: the run key of its train messages (the same
    when the server resumes the run in a new Flower run), else Flower's run id."""
    record = context.state.config_records.get(_RUN)
    key = 0 if record is None else int(str(record.get("run-key", 0)))
    return key or context.run_id


def _remember_ledger(context: Context, silo: Silo) -> None:
    """Keep the (already saved) ledger in the node's state too: a lost file cannot reset it."""
    context.state[_STATE] = ConfigRecord({"ledger": silo.ledger.to_json()})


def _guarded(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context],
                                                                          Message]:
    """Turn a silo's refusals and failures into Error replies the server can log."""

    def wrapped(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except BudgetExceeded as exc:
            logger.warning("%s", exc)
            return Message(Error(BUDGET_EXCEEDED, str(exc)), reply_to=message)
        except BadRequest as exc:
            logger.error("silo refuses a %s message: %s", message.metadata.message_type, exc)
            return Message(Error(BAD_REQUEST, str(exc)), reply_to=message)
        except (ConfigError, DataError, ValueError) as exc:
            logger.error("silo cannot run %s: %s", message.metadata.message_type, exc)
            return Message(Error(SILO_FAILED, f"{type(exc).__name__}: {exc}"), reply_to=message)

    wrapped.__name__ = handler.__name__
    return wrapped


def _model(records: dict[str, WireModel], name: str, silo: Silo) -> dict[str, torch.Tensor]:
    """The message's model ``name`` as the silo's model's tensors; BadRequest if it is
    missing, not this model, or not finite (NaN weights would make every figure NaN)."""
    if name not in records:
        raise BadRequest(f"the message carries no model '{name}'")
    try:
        state = unpack_state(records[name], silo.template())
    except (ValueError, KeyError, TypeError, EOFError, OSError) as exc:
        raise BadRequest(f"model '{name}' is not this silo's model: {exc}") from None
    if not all(bool(torch.isfinite(tensor).all()) for tensor in state.values()):
        raise BadRequest(f"model '{name}' has non-finite weights")
    return state


def _candidates(records: dict[str, WireModel], silo: Silo) -> list[dict[str, torch.Tensor]]:
    """The cluster models of a selection round: ``cluster-0`` .. ``cluster-{M-1}``, no gaps,
    at most the silo's ``max-candidates``; their number and names are checked before any is
    unpacked, and every one is unpacked and checked before any is used."""
    names = [key for key in records if key.startswith(CLUSTER_PREFIX)]
    limit = silo.silo.max_candidates
    if len(names) > limit:
        raise BadRequest(f"a selection round carries {len(names)} cluster models; this silo "
                         f"scores at most {limit} (node config 'max-candidates')")
    expected = [cluster_key(m) for m in range(len(names))]
    if not names or sorted(names) != sorted(expected):
        raise BadRequest(f"a selection round needs models {CLUSTER_PREFIX}0 .. "
                         f"{CLUSTER_PREFIX}<M-1>, got {sorted(names) or 'none'}")
    return [_model(records, name, silo) for name in expected]


@app.query()
@_guarded
def query(message: Message, context: Context) -> Message:
    silo = _open_silo(context)
    return reply(message, RecordDict({SILO: metric_record(silo.describe())}))


def handler_cpu_clock() -> Callable[[], float]:
    """The clock of the work this handler does: its own thread's CPU time when torch computes
    in the calling thread (one intra-op thread, what the benchmarks run), else the whole
    process's. A warm silo's handler runs in its SuperNode's process, whose gRPC and HTTP
    threads keep working meanwhile; the process clock would count them as the silo's work."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


@app.train()
@_guarded
def train(message: Message, context: Context) -> Message:
    clock = handler_cpu_clock()
    started = clock()
    request: TrainRequest = parse_request(TrainRequest, message)
    silo = _open_silo(context)
    with silo.charging():  # check, train and charge under the ledger's lock
        update, start, metrics = _train_round(silo, request, model_records(message.content),
                                              context)
    _remember_rounds(context, request)
    _remember_ledger(context, silo)
    metrics["epsilon-spent"] = silo.spent()
    if silo.silo.report_cpu_seconds:  # timing follows the Poisson sample: an opt-in
        metrics["cpu-seconds"] = clock() - started
    if request.personal:
        # Local training: the model stays in the silo; only metrics leave it.
        trained = {k: start[k] + update[k] for k in start}
        context.state[OWN_MODEL] = ArrayRecord(trained)
        return reply(message, one_record(METRICS, metrics))
    return reply(message, one_record(METRICS, metrics, {UPDATE: pack_state(update)}))


def _train_round(silo: Silo, request: TrainRequest, records: dict[str, WireModel],
                 context: Context) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                            dict[str, float]]:
    """Check the whole message (privatiser, work, every model), then plan, check the budget,
    (select and) train one round; returns the update, the weights it started from and the
    reply's numbers. Runs under the ledger's lock; nothing is calibrated or stored for a
    message refused by its content."""
    check_privatiser(silo, request)
    proposed = Schedule.from_request(request)
    schedule = silo.own_schedule(proposed)
    batch = silo.own_batch(request.batch, proposed)
    silo.check_work(schedule, batch)
    selecting = request.cluster == SELECT
    if selecting and request.select_ratio <= 0 and request.privatiser == "dpsgd":
        raise BadRequest("train message: a selection round (cluster = -1) needs "
                         "'select-ratio' > 0, the budget share of its private selection")
    candidates = (_candidates(records, silo) if selecting
                  else [_received_or_own(records, context, silo)])
    if request.privatiser == "dprivacy":
        return released_round(silo, request, candidates, request.cluster)
    anchor = None
    if ANCHOR in records and request.prox_variant == "correct":
        anchor = _model(records, ANCHOR, silo)
    plan = silo.plan(schedule, request.run_key)
    server_round, cluster = request.server_round, request.cluster
    cost = silo.round_cost(plan, batch, server_round, schedule.local_epochs)
    planned: list[GaussianSteps | Selection] = [cost]
    if selecting:
        planned.append(Selection(plan.epsilon_select, round=server_round))
    silo.check(planned, server_round)
    if selecting:
        cluster = silo.select(candidates, plan, server_round)
    start = candidates[cluster if selecting else 0]
    prox = None if anchor is None else (request.prox_lambda, anchor)
    dp = DPSGDConfig(plan.noise_multiplier, request.clip_norm, request.learning_rate,
                     batch, schedule.local_epochs, silo.experiment.physical_batch_size or None)
    update, metrics = silo.train(start, dp, server_round, prox)
    # z, b and the steps let the server (and an evaluation-only oracle) size the round's noise
    metrics.update({"cluster": cluster, "selected": int(selecting),
                    "noise-multiplier": plan.noise_multiplier,
                    "batch-size": silo.data.num_train if batch == "full" else batch,
                    "steps": cost.steps})
    return update, start, metrics


def _received_or_own(records: dict[str, WireModel], context: Context,
                     silo: Silo) -> dict[str, torch.Tensor]:
    """The weights the server sent (``records``: the message's models), or the silo's own
    model when it sent none (Local)."""
    if ARRAYS in records:
        return _model(records, ARRAYS, silo)
    if OWN_MODEL in context.state.array_records:
        return _model({OWN_MODEL: context.state.array_records[OWN_MODEL]}, OWN_MODEL, silo)
    raise BadRequest("no model received and no own model kept from an earlier round")


@app.evaluate()
@_guarded
def evaluate(message: Message, context: Context) -> Message:
    request: EvaluateRequest = parse_request(EvaluateRequest, message)
    silo = _open_silo(context)
    state = _received_or_own(model_records(message.content), context, silo)
    with silo.charging():  # a private evaluation is charged like a round
        silo.check(list(silo.evaluation_cost(request.server_round)), request.server_round)
        metrics, exact = silo.test(state, request.server_round)
    _remember_ledger(context, silo)
    # the silo's own copy of the model it would use; nothing of it leaves the silo
    keep_evaluated_model(silo, state, evaluated_metadata(
        silo, request.server_round, request.cluster, _planned_rounds(context), metrics, exact),
        _run_name(context))
    metrics.update({"cluster": request.cluster, "epsilon-spent": silo.spent()})
    return reply(message, RecordDict({METRICS: metric_record(metrics)}))
