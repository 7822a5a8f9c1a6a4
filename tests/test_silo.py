"""A silo's own privacy decisions, and the real ClientApp handling real messages."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.methods.base import ServerState
from dpcfl_flwr.methods.rdpcfl import RDPCFL
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyLedger, Selection
from dpcfl_flwr.protocol import (
    ARRAYS,
    BUDGET_EXCEEDED,
    CONFIG,
    METRICS,
    ROUND_REPEATED,
    SELECT,
    SILO,
    UPDATE,
    ModelLayout,
    cluster_key,
    metrics_of,
    model_records,
)
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo.silo import MAX_PLANS, BudgetExceeded, Schedule, Silo

N = 80


@pytest.fixture()
def experiment(tmp_path):
    return parse_run_config({"clusters": "1,1", "samples-per-client": N, "test-samples": 40,
                             "num-server-rounds": 5, "epsilon": 4.0, "rdpcfl.select-window": 0.4,
                             "out-dir": str(tmp_path / "run")})


def _schedule(experiment) -> Schedule:
    """R-DPCFL's schedule for ``experiment``, as its method proposes it."""
    state = ServerState(np.zeros(1, np.float32))
    return RDPCFL(experiment, experiment.methods["rdpcfl"], state).schedule()


def _silo(experiment, run_id=7, partition=1, **node):
    """A silo as in simulation: what its node config leaves unset comes from the run config."""
    return Silo(parse_node_config({"partition-id": partition, **node}), experiment, run_id,
                trust_run_config=True)


@pytest.fixture()
def simulation(monkeypatch):
    """The ClientApp as Flower's simulation engine runs it (one operator plays every role);
    tests/test_simulation.py runs the engine itself."""
    monkeypatch.setattr("dpcfl_flwr.client_app.running_in_simulation", lambda: True)


def _charge_first_round(silo, plan) -> None:
    silo.charge([silo.round_cost(plan, "full", 1, 1)])


def test_plan_is_made_once_per_run_and_survives_a_restart(experiment):
    silo = _silo(experiment)
    plan = silo.plan(_schedule(experiment))
    _charge_first_round(silo, plan)
    silo.persist()
    restarted = _silo(experiment)
    assert restarted.plan(_schedule(experiment)) == plan
    assert restarted.ledger.meta["runs"]["7"]["noise_multiplier"] == plan.noise_multiplier


def test_a_plan_is_kept_only_once_a_round_is_charged(experiment):
    silo = _silo(experiment)
    silo.plan(_schedule(experiment))
    silo.persist()
    assert "runs" not in silo.ledger.meta and not silo.ledger.entries


def test_a_ledger_keeps_at_most_its_limit_of_plans(experiment, monkeypatch):
    monkeypatch.setattr("dpcfl_flwr.silo.silo.MAX_PLANS", 3)
    # plan bookkeeping, whatever the accountant: RDP calibrates five plans in milliseconds,
    # PLD (the default) in seconds each, every later plan on a longer history
    silo = _silo(experiment, accountant="rdp")
    for run_key in range(1, 6):
        silo.plan(_schedule(experiment), run_key)
        silo.charge([Selection(0.01, round=1)])
    assert list(silo.ledger.meta["runs"]) == ["3", "4", "5"]  # the oldest dropped
    assert MAX_PLANS >= 16  # a silo that runs many experiments keeps its recent plans


def test_a_changed_schedule_in_the_same_run_is_refused(experiment):
    silo = _silo(experiment)
    _charge_first_round(silo, silo.plan(_schedule(experiment)))
    longer = Schedule(50, 1, 32, "full", 2, 0.03, "classic", "split")
    with pytest.raises(BudgetExceeded, match="changed the DP schedule"):
        silo.plan(longer)


def test_a_second_run_fits_into_what_the_first_left(experiment, caplog):
    first = _silo(experiment, run_id=1)
    plan = first.plan(_schedule(experiment))
    first.ledger.record([GaussianSteps(plan.noise_multiplier, 1.0, 1, round=1)])
    first.persist()
    second = _silo(experiment, run_id=2)
    later = second.plan(_schedule(experiment))
    assert later.noise_multiplier > plan.noise_multiplier  # less budget left, more noise
    assert (f"silo 1 starts run 2 with epsilon {first.spent():.4g} of 4 already spent in "
            f"earlier runs: z={later.noise_multiplier:.4f}") in caplog.text  # and says so
    # Running the whole second schedule on top of the first run stays within the budget.
    whole = [second.round_cost(later, "full", 1, 1)] + [
        second.round_cost(later, 32, r, 1) for r in range(2, 6)] + [
        Selection(later.epsilon_select, round=r) for r in (3, 4)]
    assert not second.ledger.would_exceed(whole, second.budget)


def test_check_refuses_with_a_reason(experiment):
    silo = _silo(experiment)
    huge = GaussianSteps(0.1, 1.0, 50, round=3)
    with pytest.raises(BudgetExceeded, match="refuses round 3: it would spend eps=.* > budget 4"):
        silo.check([huge], 3)


def test_the_longer_history_wins_between_state_and_file(experiment):
    silo = _silo(experiment)
    silo.ledger.record([GaussianSteps(1.0, 0.1, 5, round=1), GaussianSteps(1.0, 0.1, 5, round=2)])
    state_json = silo.ledger.to_json()
    silo.ledger.entries.pop()
    silo.persist()  # the file now lags behind the state (e.g. restored from a backup)
    reopened = Silo(parse_node_config({"partition-id": 1}), experiment, 7, state_json,
                    trust_run_config=True)
    assert len(reopened.ledger.entries) == 2


def test_node_config_overrides_the_run_config_budget(experiment, tmp_path):
    silo = _silo(experiment, epsilon=2.5, delta=1e-5, **{"ledger-path": str(tmp_path / "l.json"),
                                                        "true-cluster": 1})
    described = silo.describe()
    assert (described["epsilon-budget"], described["delta"]) == (2.5, 1e-5)
    assert described["true-cluster"] == 1 and described["num-train"] == N
    silo.persist()
    assert (tmp_path / "l.json").exists()


# --- the real ClientApp -----------------------------------------------------------------------
def _context(experiment, partition=1) -> Context:
    return Context(run_id=11, node_id=500 + partition,
                   node_config={"partition-id": partition, "num-partitions": 2},
                   state=RecordDict(), run_config=experiment.to_run_config())


def _message(content: RecordDict, kind: str, node: int) -> Message:
    message = Message(content, dst_node_id=node, message_type=kind)
    message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return message


def _train_content(experiment, server_round, cluster, models):
    config = {"server-round": server_round, "stage": "x", "cluster": cluster,
              "round-batch": "full" if server_round == 1 else "32", "learning-rate": 0.01,
              "clip-norm": 1.0, **_schedule(experiment).to_config()}
    content = RecordDict({CONFIG: ConfigRecord(config)})
    if cluster == SELECT:
        for m, record in enumerate(models):
            content[cluster_key(m)] = record
    else:
        content[ARRAYS] = models[0]
    return content


def test_client_app_trains_charges_selects_and_refuses(server_task_identity, simulation,
                                                       experiment):
    context = _context(experiment)
    query = client_app(_message(RecordDict({CONFIG: ConfigRecord({"server-round": 0})}),
                                "query", 501), context)
    assert int(query.content.metric_records[SILO]["partition-id"]) == 1
    model = initial_arrays(experiment)
    first = client_app(_message(_train_content(experiment, 1, -2, [model]), "train", 501),
                       context)
    metrics = metrics_of(first)
    assert list(first.content) == [METRICS]  # the update travels inside the one record
    update = ModelLayout.of(model).flatten(model_records(first.content)[UPDATE])
    assert np.abs(update).sum() > 0
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert [(e.sample_rate, e.round) for e in ledger.entries] == [(1.0, 1)]
    assert metrics["epsilon-spent"] == pytest.approx(ledger.spent(
        _silo(experiment, 11).budget))
    second = client_app(_message(_train_content(experiment, 2, SELECT, [model, model]),
                                 "train", 501), context)
    assert metrics_of(second)["selected"] == 1
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert [e.kind for e in ledger.entries] == ["gaussian", "selection", "gaussian"]
    # An earlier run's history pushes this silo over its budget: it must refuse, not train.
    ledger.record([GaussianSteps(0.2, 1.0, 10, round=None)])
    ledger.save(experiment.ledger_directory() / "silo-1.json")
    context.state = RecordDict()
    refused = client_app(_message(_train_content(experiment, 3, 0, [model]), "train", 501),
                         context)
    assert refused.has_error() and refused.error.code == BUDGET_EXCEEDED
    assert "refuses round 3" in refused.error.reason
    after = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert len(after.entries) == len(ledger.entries)  # nothing charged for a refused round


def test_a_resumed_run_does_not_train_a_round_again_and_goes_on_with_the_next(
        server_task_identity, simulation, experiment):
    """A server resumed after a round's message reached the silo asks for that round again
    (a new Flower run, the same run key): under the whole-budget default the repeat would
    not fit, and refusing it as over budget stopped the silo for the rest of the run."""
    model = initial_arrays(experiment)
    path = experiment.ledger_directory() / "silo-1.json"

    def train(context, server_round, run_key=77):
        content = _train_content(experiment, server_round, 0 if server_round > 1 else -2,
                                 [model])
        content[CONFIG]["run-key"] = run_key
        return client_app(_message(content, "train", 501), context)

    first_run = _context(experiment)
    assert not train(first_run, 1).has_error() and not train(first_run, 2).has_error()
    charged = PrivacyLedger.load(path).entries
    resumed = _context(experiment)  # the resumed run: a new Flower run, a new context
    resumed.run_id = 12
    again = train(resumed, 2)
    assert again.has_error() and again.error.code == ROUND_REPEATED
    assert "already ran and charged train round 2" in again.error.reason
    assert PrivacyLedger.load(path).entries == charged  # nothing released, nothing charged
    assert not train(resumed, 3).has_error()  # its next round, as planned
    assert [e.round for e in PrivacyLedger.load(path).entries] == [1, 2, 3]
    other_run = _context(experiment)  # another run (another key) has its own round 2
    assert not train(other_run, 2, run_key=78).has_error()
    # Evaluation with private metrics is charged once per round of a run, too.
    evaluate = _message(RecordDict({ARRAYS: model, CONFIG: ConfigRecord(
        {"server-round": 3, "cluster": 0})}), "evaluate", 501)
    node = {"metrics": "private"}
    for context in (first_run, resumed):
        context.node_config = {**context.node_config, **node}
    assert not client_app(evaluate, resumed).has_error()
    repeated = client_app(_message(evaluate.content, "evaluate", 501), resumed)
    assert repeated.has_error() and repeated.error.code == ROUND_REPEATED


def test_client_app_evaluates_on_its_test_split(server_task_identity, simulation, experiment):
    reply = client_app(_message(RecordDict({
        ARRAYS: initial_arrays(experiment),
        CONFIG: ConfigRecord({"server-round": 5, "cluster": 0})}), "evaluate", 501),
        _context(experiment))
    metrics = reply.content.metric_records[METRICS]
    assert metrics["num-examples"] == 40 and 0.0 <= metrics["test-accuracy"] <= 1.0


def test_client_app_reports_a_bad_run_config_as_an_error(server_task_identity, simulation,
                                                          experiment):
    context = _context(experiment)
    context.run_config = {**context.run_config, "epsilon": -3.0}
    reply = client_app(_message(RecordDict({CONFIG: ConfigRecord({"server-round": 0})}),
                                "query", 501), context)
    assert reply.has_error() and "'epsilon' = -3.0 is invalid" in reply.error.reason


def test_array_record_round_trip_is_lossless(experiment):
    record = initial_arrays(experiment)
    state = record.to_torch_state_dict()
    assert ArrayRecord(state).object_id == record.object_id


def test_simulation_fills_only_what_the_node_config_leaves_unset(experiment):
    run = parse_run_config({**experiment.to_run_config(), "seed": 5, "threads": 1})
    own = parse_node_config({"partition-id": 1, "data-seed": 0, "test-samples": 0})
    resolved = own.resolved(run, trust_run_config=True)
    assert (resolved.data_seed, resolved.test_samples) == (0, 0)  # explicit zeros are kept
    assert (resolved.epsilon, resolved.samples_per_client, resolved.threads) == (4.0, N, 1)
    deployed = parse_node_config({"partition-id": 1, "epsilon": 2.0, "delta": 1e-6,
                                  "ledger-path": "l.json"}).resolved(run, trust_run_config=False)
    assert (deployed.samples_per_client, deployed.data_seed, deployed.metrics) == (500, 0,
                                                                                    "private")


_OPEN_A_SILO = """
import sys
from flwr.app import Context, RecordDict
from dpcfl_flwr import client_app
context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "ledger-path": sys.argv[1],
                                                   "epsilon": 5.0, "delta": 1e-5},
                  state=RecordDict(), run_config={"clusters": "1,1", "samples-per-client": 40,
                                                  "test-samples": 20})
client_app._open_silo(context).describe()
print(" ".join(m for m in ("sklearn", "pandas", "opacus") if m in sys.modules))
"""


def test_a_silo_loads_no_server_side_library(tmp_path):
    """Reading a run config loads every method's module, R-DPCFL's clustering and k-means
    among them; a silo never clusters, and scikit-learn with the pandas it loads held ~70 MB
    of each deployed silo's process. Opened and describing its records, a fresh process
    holds neither (nor Opacus, for a model the layerwise engine trains)."""
    import subprocess
    import sys
    from pathlib import Path

    loaded = subprocess.run([sys.executable, "-c", _OPEN_A_SILO, str(tmp_path / "ledger.json")],
                            check=True, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert loaded == []
