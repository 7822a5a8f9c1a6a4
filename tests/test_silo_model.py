"""The silo owns its result: at every evaluation it writes the model it would
use beside its ledger, marks the run's last one final, and the file loads into a model whose
accuracy on the silo's test split is the one reported."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.dpsgd.training import evaluate
from dpcfl_flwr.methods.base import INITIAL, ServerState
from dpcfl_flwr.methods.rdpcfl import RDPCFL
from dpcfl_flwr.protocol import ARRAYS, CONFIG, METRICS, OWN, OWN_MODEL
from dpcfl_flwr.runs.simulation import run_simulation
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo.kept_model import load_silo_model, model_files, model_path, read_metadata
from dpcfl_flwr.silo.silo import Silo

ROUNDS = 4


@pytest.fixture()
def experiment(tmp_path):
    return parse_run_config({"clusters": "1,1", "samples-per-client": 80, "test-samples": 40,
                             "num-server-rounds": ROUNDS, "epsilon": 4.0,
                             "out-dir": str(tmp_path / "run")})


@pytest.fixture()
def simulation(monkeypatch):
    """The ClientApp as Flower's simulation engine runs it (settings from the run config)."""
    monkeypatch.setattr("dpcfl_flwr.client_app.running_in_simulation", lambda: True)


def _context(experiment, run_id=11, **node) -> Context:
    return Context(run_id=run_id, node_id=501, node_config={"partition-id": 1, **node},
                   state=RecordDict(), run_config=experiment.to_run_config())


def _send(context: Context, kind: str, config: dict, with_model: bool = True) -> Message:
    content = RecordDict({CONFIG: ConfigRecord(config)})
    if with_model:
        content[ARRAYS] = initial_arrays(parse_run_config(context.run_config))
    message = Message(content, dst_node_id=501, message_type=kind)
    message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    reply = client_app(message, context)
    assert not reply.has_error(), reply.error.reason
    return reply


def _train(context: Context, experiment, cluster: int = 0, personal: int = 0) -> None:
    schedule = replace(RDPCFL(experiment, experiment.methods["rdpcfl"],
                              ServerState(np.zeros(1, np.float32))).schedule(), evaluations=2)
    _send(context, "train", {"server-round": 1, "stage": "x", "cluster": cluster,
                             "round-batch": "full", "learning-rate": 0.01, "clip-norm": 1.0,
                             "personal": personal, **schedule.to_config()})


def _evaluate(context: Context, server_round: int, cluster: int = 0) -> float:
    reply = _send(context, "evaluate", {"server-round": server_round, "cluster": cluster},
                  with_model=cluster != OWN)
    return float(reply.content.metric_records[METRICS]["test-accuracy"])


def _file(experiment, run_id: int = 11):
    return model_path(experiment.ledger_directory() / "silo-1.json", run_id)


def test_every_evaluation_writes_the_model_and_the_last_round_marks_it_final(
        server_task_identity, simulation, experiment):
    context = _context(experiment)
    _train(context, experiment)
    accuracy = _evaluate(context, 2)
    meta = read_metadata(_file(experiment))
    assert (meta["round"], meta["rounds"], meta["final"], meta["cluster"]) == (2, ROUNDS,
                                                                                False, 0)
    assert meta["test_accuracy"] == meta["reported_test_accuracy"] == accuracy  # exact metrics
    assert meta["epsilon_spent"] > 0 and meta["epsilon_budget"] == 4.0
    _evaluate(context, ROUNDS)
    assert read_metadata(_file(experiment))["final"] is True
    _evaluate(context, 3)  # asked again after the end: the final model stays
    _evaluate(context, ROUNDS + 5)
    meta = read_metadata(_file(experiment))
    assert (meta["round"], meta["final"]) == (ROUNDS, True)
    assert [p.name for p in model_files(experiment.ledger_directory() / "silo-1.json")] == [
        "silo-1.run-11.model.pt"]


def test_a_personal_silo_writes_its_own_model(server_task_identity, simulation, experiment):
    context = _context(experiment)
    _train(context, experiment, cluster=INITIAL, personal=1)
    accuracy = _evaluate(context, ROUNDS, cluster=OWN)
    model, meta = load_silo_model(_file(experiment))
    assert (meta["final"], meta["own_model"], meta["cluster"]) == (True, True, OWN)
    own = context.state.array_records[OWN_MODEL].to_torch_state_dict()
    assert all(torch.equal(model.state_dict()[k], own[k]) for k in own)
    assert meta["test_accuracy"] == accuracy


def test_private_metrics_keep_the_exact_accuracy_and_the_reported_one(
        server_task_identity, simulation, experiment):
    context = _context(experiment, metrics="private")
    _train(context, experiment)
    reported = _evaluate(context, ROUNDS)
    model, meta = load_silo_model(_file(experiment))
    assert meta["metrics"] == "private" and meta["reported_test_accuracy"] == reported
    silo = Silo(parse_node_config({"partition-id": 1}), experiment, 11, trust_run_config=True)
    assert meta["test_accuracy"] == evaluate(model, silo.data.x_test, silo.data.y_test)[1]
    assert meta["test_accuracy"] != reported  # noised by N(0, 14^2) records


def test_a_second_run_writes_its_own_file(server_task_identity, simulation, experiment):
    first = _context(experiment, run_id=11)
    _train(first, experiment)
    _evaluate(first, ROUNDS)
    before = _file(experiment, 11).read_bytes()
    second = _context(experiment, run_id=12)
    _evaluate(second, 2)  # no train message of run 12 yet: its schedule is unknown
    assert _file(experiment, 11).read_bytes() == before
    meta = read_metadata(_file(experiment, 12))
    assert (meta["run_id"], meta["rounds"], meta["final"]) == (12, None, False)


def test_a_damaged_file_is_refused_with_its_path(tmp_path):
    damaged = tmp_path / "silo-0.run-1.model.pt"
    damaged.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="silo-0.run-1.model.pt: not a silo model file"):
        load_silo_model(damaged)


def test_after_a_simulation_every_silo_holds_its_final_model(tmp_path):
    out = tmp_path / "run"
    experiment = parse_run_config({
        "clusters": "2,2", "rdpcfl.n-clusters": 2, "samples-per-client": 64,
        "test-samples": 40, "num-server-rounds": 3, "eval-every": 2, "out-dir": str(out)})
    run_simulation(experiment)
    results = json.loads((out / "results.json").read_text())
    assert len(results["clients"]) == 4
    for client in results["clients"]:
        partition = client["partition"]
        (path,) = model_files(out / "ledgers" / f"silo-{partition}.json")
        model, meta = load_silo_model(path)
        assert (meta["partition_id"], meta["round"], meta["final"]) == (partition, 3, True)
        assert meta["cluster"] == client["final_cluster"]
        assert meta["test_accuracy"] == client["test_accuracy"]
        assert meta["epsilon_spent"] == pytest.approx(client["epsilon_spent"])
        silo = Silo(parse_node_config({"partition-id": partition}), experiment,
                    meta["run_id"], trust_run_config=True)
        assert evaluate(model, silo.data.x_test, silo.data.y_test)[1] == client["test_accuracy"]


def test_dpcfl_client_names_the_file_and_prints_what_was_written(
        server_task_identity, simulation, experiment, capfd):
    from dpcfl_flwr.deploy.silo_command import _model_pattern
    from dpcfl_flwr.deploy.silo_supervisor import print_models

    ledger = experiment.ledger_directory() / "silo-1.json"
    assert _model_pattern(str(ledger)) == str(ledger.parent / "silo-1.run-<run id>.model.pt")
    context = _context(experiment)
    _train(context, experiment)
    _evaluate(context, ROUNDS)
    capfd.readouterr()
    print_models(str(ledger), since=0.0)
    shown = capfd.readouterr().out  # printed by a child process (torch reads the file)
    assert "silo 1: final model of run 11 (cluster 0, test accuracy" in shown
    assert "silo-1.run-11.model.pt" in shown
