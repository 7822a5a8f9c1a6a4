"""The ClientApp: a silo's ``query``, ``train`` and ``evaluate`` handlers (thin Flower glue).

Everything privacy-relevant happens in :mod:`dpcfl_flwr.silo`. The ledger is saved to the
silo's disk before a reply leaves; a round that would overspend is answered with an Error
carrying :data:`~dpcfl_flwr.protocol.BUDGET_EXCEEDED` and the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from .config import ConfigError, parse_node_config, parse_run_config
from .data import DataError
from .privacy import GaussianSteps, Selection
from .protocol import (
    ANCHOR,
    ARRAYS,
    BUDGET_EXCEEDED,
    METRICS,
    OWN_MODEL,
    SELECT,
    SILO,
    SILO_FAILED,
    UPDATE,
    WireModel,
    batch_of,
    cluster_key,
    config_of,
    integer,
    metric_record,
    model_records,
    number,
    one_record,
    pack_state,
    reply,
    unpack_state,
)
from .silo import BudgetExceeded, Schedule, Silo
from .training import DPSGDConfig

logger = logging.getLogger(__name__)

app = ClientApp()

_STATE = "privacy"


def _open_silo(context: Context) -> Silo:
    experiment = parse_run_config(context.run_config)
    silo = parse_node_config(context.node_config)
    record = context.state.config_records.get(_STATE)
    return Silo(silo, experiment, context.run_id,
                str(record["ledger"]) if record is not None else None)


def _close_silo(context: Context, silo: Silo) -> None:
    context.state[_STATE] = ConfigRecord({"ledger": silo.persist()})


def _guarded(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context],
                                                                          Message]:
    """Turn a silo's refusals and failures into Error replies the server can log."""

    def wrapped(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except BudgetExceeded as exc:
            logger.warning("%s", exc)
            return Message(Error(BUDGET_EXCEEDED, str(exc)), reply_to=message)
        except (ConfigError, DataError, ValueError) as exc:
            logger.error("silo cannot run %s: %s", message.metadata.message_type, exc)
            return Message(Error(SILO_FAILED, f"{type(exc).__name__}: {exc}"), reply_to=message)

    wrapped.__name__ = handler.__name__
    return wrapped


def _state(record: WireModel, silo: Silo) -> dict[str, torch.Tensor]:
    return unpack_state(record, silo.template())


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
    silo = _open_silo(context)
    config = config_of(message)
    server_round = integer(config, "server-round")
    schedule = Schedule.from_config(config)
    plan = silo.plan(schedule)
    batch = batch_of(config, "round-batch")
    cluster = integer(config, "cluster")
    selecting = cluster == SELECT
    planned: list[GaussianSteps | Selection] = [
        silo.round_cost(plan, batch, server_round, schedule.local_epochs)]
    if selecting:
        planned.append(Selection(plan.epsilon_select, round=server_round))
    try:
        silo.check(planned, server_round)
    finally:
        _close_silo(context, silo)  # keep the plan even when refusing
    records = model_records(message.content)
    if selecting:
        n_clusters = sum(1 for key in records if key.startswith("cluster-"))
        candidates = [_state(records[cluster_key(m)], silo) for m in range(n_clusters)]
        cluster = silo.select(candidates, plan, server_round)
        start = candidates[cluster]
    else:
        start = _received_or_own(records, context, silo)
    prox = None
    if ANCHOR in records and str(config.get("prox-variant", "correct")) == "correct":
        prox = (number(config, "prox-lambda"), _state(records[ANCHOR], silo))
    dp = DPSGDConfig(plan.noise_multiplier, number(config, "clip-norm"),
                     number(config, "learning-rate"), batch, schedule.local_epochs,
                     silo.experiment.physical_batch_size or None)
    update, metrics = silo.train(start, dp, server_round, prox)
    _close_silo(context, silo)  # charged on disk before anything leaves the silo
    metrics.update({"cluster": cluster, "selected": int(selecting),
                    "epsilon-spent": silo.spent(), "noise-multiplier": plan.noise_multiplier,
                    "cpu-seconds": clock() - started})
    if "personal" in config and integer(config, "personal") == 1:
        # Local training: the model stays in the silo; only metrics leave it.
        trained = {k: start[k] + update[k] for k in start}
        context.state[OWN_MODEL] = ArrayRecord(trained)
        return reply(message, one_record(METRICS, metrics))
    return reply(message, one_record(METRICS, metrics, {UPDATE: pack_state(update)}))


def _received_or_own(records: dict[str, WireModel], context: Context,
                     silo: Silo) -> dict[str, torch.Tensor]:
    """The weights the server sent (``records``: the message's models), or the silo's own
    model when it sent none (Local)."""
    if ARRAYS in records:
        return _state(records[ARRAYS], silo)
    if OWN_MODEL in context.state.array_records:
        return _state(context.state.array_records[OWN_MODEL], silo)
    raise ValueError("no model received and no own model kept from an earlier round "
                     f"(state has {sorted(context.state.keys())})")


@app.evaluate()
@_guarded
def evaluate(message: Message, context: Context) -> Message:
    silo = _open_silo(context)
    config = config_of(message)
    metrics = silo.test(_received_or_own(model_records(message.content), context, silo))
    metrics.update({"cluster": integer(config, "cluster"), "epsilon-spent": silo.spent()})
    return reply(message, RecordDict({METRICS: metric_record(metrics)}))
