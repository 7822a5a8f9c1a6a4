"""The ClientApp: a silo's ``query``, ``train`` and ``evaluate`` handlers (thin Flower glue).

Each handler parses the message, makes one call into the silo package and replies: every field
is validated first (:mod:`dpcfl_flwr.silo.requests`; a bad one is answered with an Error
carrying :data:`~dpcfl_flwr.protocol.BAD_REQUEST`, nothing charged), then
:mod:`dpcfl_flwr.silo.round` accepts the round whole and runs it through the silo's privatiser
under the ledger's lock; the ledger is on the silo's disk before a reply leaves, and a round
that would overspend is answered with an Error carrying
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
from .data.readers import release_cached_datasets
from .protocol import (
    BAD_REQUEST,
    BUDGET_EXCEEDED,
    METRICS,
    OWN_MODEL,
    ROUND_REPEATED,
    SILO,
    SILO_FAILED,
    UPDATE,
    WireModel,
    metric_record,
    model_records,
    one_record,
    pack_state,
    reply,
)
from .runs.heap import after_reply, message_answered, message_started
from .silo.requests import BadRequest, EvaluateRequest, TrainRequest, parse_request
from .silo.round import evaluate_round, train_round
from .silo.silo import BudgetExceeded, RoundRepeated, Silo, SiloSettingsError

logger = logging.getLogger(__name__)

app = ClientApp()

_STATE = "privacy"
#: The run's schedule as its first valid train message announced it (``rounds``): how the
#: silo tells the final evaluation, and so its final model (:mod:`.silo.kept_model`), from others.
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
    """The silo for this message; the run config is checked first (its errors are the
    server's own values, so they are answered in full), then the silo's own settings and
    (deployed) its pinned schema, all before any record is read."""
    simulated = running_in_simulation()
    experiment = parse_run_config(context.run_config)
    try:
        node = parse_node_config(context.node_config)
    except ConfigError as exc:
        raise SiloSettingsError(str(exc)) from None
    record = context.state.config_records.get(_STATE)
    return Silo(node, experiment, context.run_id,
                str(record["ledger"]) if record is not None else None,
                trust_run_config=simulated, own_process=not simulated)


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


#: What a refusal that is not the message's fault says, by what failed. Fixed texts: the
#: details (paths, file and column names, values, rows) are the silo's and stay in its log
#: (docs/threat-model.md#what-a-message-can-learn-about-a-silos-records).
FAILURE_REASONS: dict[type[BaseException], str] = {
    SiloSettingsError: "the silo's own settings (node config, schema file) cannot be used; "
                       "its operator finds why in its log",
    DataError: "the silo's records cannot be read under its schema; its operator finds why in "
               "its log",
    Exception: "the silo failed on this message; its operator finds why in its log",
}


def failure_reason(exc: BaseException) -> str:
    """The fixed reason a failure of kind ``exc`` is answered with."""
    return next(text for kind, text in FAILURE_REASONS.items() if isinstance(exc, kind))


def _failure_text(exc: BaseException, deployed: bool) -> str:
    """A failure's reply: its fixed reason when deployed; in simulation, where one operator
    plays the server and every silo, the details themselves, in one line."""
    if deployed:
        return failure_reason(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def _guarded(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context],
                                                                          Message]:
    """Turn a silo's refusals and failures into Error replies the server can log. Refusals of
    the message (its fields, its run config, the budget) say why; any other failure, a
    plug-in's included, is answered with a fixed reason of its kind, its details logged
    here only: nothing is released and nothing more is charged."""

    def wrapped(message: Message, context: Context) -> Message:
        deployed = not running_in_simulation()
        if deployed:
            message_started()
        kind = message.metadata.message_type
        try:
            return handler(message, context)
        except BudgetExceeded as exc:
            logger.warning("%s", exc)
            return Message(Error(BUDGET_EXCEEDED, str(exc)), reply_to=message)
        except RoundRepeated as exc:
            logger.warning("%s", exc)
            return Message(Error(ROUND_REPEATED, str(exc)), reply_to=message)
        except BadRequest as exc:
            logger.error("silo refuses a %s message: %s", kind, exc)
            return Message(Error(BAD_REQUEST, str(exc)), reply_to=message)
        except ConfigError as exc:  # the run config (or the model it names) cannot run here
            logger.error("silo cannot run %s: %s", kind, exc)
            return Message(Error(SILO_FAILED, f"ConfigError: {exc}"), reply_to=message)
        except (SiloSettingsError, DataError) as exc:
            logger.error("silo cannot run %s: %s", kind, exc)
            return Message(Error(SILO_FAILED, _failure_text(exc, deployed)), reply_to=message)
        except Exception as exc:  # noqa: BLE001 - a plug-in may raise anything
            logger.exception("silo failed on a %s message", kind)
            return Message(Error(SILO_FAILED, _failure_text(exc, deployed)), reply_to=message)
        finally:
            if deployed:
                # a deployed silo answers for one partition, whose records it caches
                # (silo/silo.py): the benchmark they were sliced from is dead weight until
                # another run asks for other records; and what the message's round freed
                # goes back to the system once the silo has gone idle (runs/heap.py)
                after_reply(release_cached_datasets)
                after_reply(message_answered)

    wrapped.__name__ = handler.__name__
    return wrapped


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


def _models(message: Message, context: Context) -> dict[str, WireModel]:
    """The message's models by name, and the silo's own model when its node keeps one."""
    models = model_records(message.content)
    own = context.state.array_records.get(OWN_MODEL)
    if own is not None:
        models[OWN_MODEL] = own
    return models


@app.train()
@_guarded
def train(message: Message, context: Context) -> Message:
    clock = handler_cpu_clock()
    started = clock()
    request: TrainRequest = parse_request(TrainRequest, message)
    silo = _open_silo(context)
    outcome = train_round(silo, request, _models(message, context))
    _remember_rounds(context, request)
    _remember_ledger(context, silo)
    metrics = outcome.metrics
    metrics["epsilon-spent"] = silo.spent()
    if silo.silo.report_cpu_seconds:  # timing follows the Poisson sample: an opt-in
        metrics["cpu-seconds"] = clock() - started
    if outcome.update is None or outcome.start is None:  # nothing trained (majority)
        return reply(message, one_record(METRICS, metrics))
    if request.personal:
        # Local training: the model stays in the silo; only metrics leave it.
        trained = {k: outcome.start[k] + outcome.update[k] for k in outcome.start}
        context.state[OWN_MODEL] = ArrayRecord(trained)
        return reply(message, one_record(METRICS, metrics))
    return reply(message, one_record(METRICS, metrics, {UPDATE: pack_state(outcome.update)}))


@app.evaluate()
@_guarded
def evaluate(message: Message, context: Context) -> Message:
    request: EvaluateRequest = parse_request(EvaluateRequest, message)
    silo = _open_silo(context)
    metrics = evaluate_round(silo, request, _models(message, context),
                             _planned_rounds(context), _run_name(context))
    _remember_ledger(context, silo)
    return reply(message, RecordDict({METRICS: metric_record(metrics)}))
