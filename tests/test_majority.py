"""The majority-class baseline: the silo's private choice of class (the exponential mechanism
over its training label counts, charged once per run), its evaluation through the ordinary
path, and a whole run of three silos with skewed labels whose figures are checked against
scikit-learn and the silos' own splits."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from rich.console import Console
from sklearn.metrics import balanced_accuracy_score

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger, Selection
from dpcfl_flwr.privacy.metrics import release_sensitivity
from dpcfl_flwr.privacy.selection import selection_rdp
from dpcfl_flwr.protocol import (
    BAD_REQUEST,
    CONFIG,
    MAJORITY,
    METRICS,
    UPDATE,
    ModelLayout,
    metrics_of,
    one_record,
    pack,
)
from dpcfl_flwr.runs.progress import summary_table
from dpcfl_flwr.server_app import run_experiment
from dpcfl_flwr.silo.majority import choose_class
from dpcfl_flwr.silo.silo import Silo
from dpcfl_flwr.strategies.replies import evaluate_reply, train_reply
from tests.grid_double import GridDouble
from tests.test_malicious_server import (
    DELTA,
    EPSILON,
    Attacker,
    _node_config,
    _refused,
    _schedule,
    silo_data,
)

RATIO = 0.05  # [majority] select-ratio


def test_the_choice_follows_the_exponential_mechanism_over_the_label_counts():
    counts, epsilon = np.array([10, 14, 12, 3]), 0.5
    rng = np.random.default_rng(0)
    draws = np.bincount([choose_class(counts, epsilon, rng) for _ in range(40000)], minlength=4)
    weights = np.exp(epsilon * counts / 2)  # sensitivity 1: exp(eps u / (2 * 1))
    np.testing.assert_allclose(draws / draws.sum(), weights / weights.sum(), atol=0.01)
    # a clear majority wins almost surely at a modest epsilon
    assert {choose_class(np.array([20, 240, 40]), 0.4, rng) for _ in range(200)} == {1}


def _train(attacker: Attacker, server_round: int, **config: Any) -> Message:
    fields = {"server-round": server_round, "stage": "majority", "cluster": MAJORITY,
              "round-batch": "32", "learning-rate": 0.05, "clip-norm": 1.0, "personal": 1,
              **_schedule(select_rounds=1, select_ratio=RATIO, first_batch=32), **config}
    return attacker.send("train", one_record(CONFIG, fields))


def _evaluate(attacker: Attacker, server_round: int) -> Message:
    return attacker.send("evaluate", one_record(
        CONFIG, {"server-round": server_round, "cluster": MAJORITY}))


def test_a_silo_chooses_once_charges_one_selection_and_evaluates_its_class(
        tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, metrics="exact"))
    _refused(_evaluate(attacker, 1), BAD_REQUEST, "chose no class")
    _refused(_train(attacker, 1, **{"select-ratio": 0.0}), BAD_REQUEST, "'select-ratio' > 0")
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries

    first = _train(attacker, 1)
    reply = metrics_of(first)
    label = int(reply["majority-class"])
    assert UPDATE not in first.content and reply["cluster"] == MAJORITY
    assert (reply["selected"], reply["noise-multiplier"]) == (1, 0.0)
    eps_select = RATIO * EPSILON
    assert attacker.ledger().entries == [Selection(eps_select, 1, 1)]
    plans = attacker.ledger().meta["runs"]
    assert [(p["noise_multiplier"], p["epsilon_select"]) for p in plans.values()] == [
        (0.0, pytest.approx(eps_select))]
    # later rounds and a repeat answer with the kept class, at no cost
    for server_round in (2, 2, 3):
        again = metrics_of(_train(attacker, server_round))
        assert (again["majority-class"], again["selected"]) == (label, 0)
    assert len(attacker.ledger().entries) == 1

    # Its spend: one eps_select-DP mechanism. Its exact (eps, delta) curve is randomized
    # response's, delta(eps) = (e^e0 - e^eps) / (1 + e^e0) below e0, so at the silo's delta
    # eps = ln(e^e0 - delta (1 + e^e0)); the silo's accountant may only be above that, and
    # (PLD on a 1e-4-nat grid) by little.
    e0 = eps_select
    exact = math.log(math.exp(e0) - DELTA * (1 + math.exp(e0)))
    spent = attacker.spent()
    assert exact - 1e-9 <= spent <= exact + 2e-3
    assert reply["epsilon-spent"] == pytest.approx(spent)

    evaluated = _evaluate(attacker, 3)
    figures = metrics_of(evaluated)
    y_test = silo_data(attacker).y_test.numpy()
    counts = np.bincount(y_test, minlength=10)
    assert figures["test-accuracy"] == pytest.approx(counts[label] / len(y_test))
    assert figures["class-count"] == counts.tolist()
    assert figures["class-correct"] == [counts[k] if k == label else 0 for k in range(10)]
    checked = evaluate_reply(evaluated, 10)
    assert checked.balanced_accuracy == pytest.approx(
        balanced_accuracy_score(y_test, np.full_like(y_test, label)))
    assert checked.auroc is None  # ten classes
    assert len(attacker.ledger().entries) == 1  # exact metrics: free
    attacker.assert_within_budget()


def test_a_private_majority_evaluation_is_one_charged_release(tmp_path, server_task_identity):
    attacker = Attacker(tmp_path)  # a deployed silo: private metrics, metrics-noise 10
    assert not _train(attacker, 1).has_error()
    figures = metrics_of(_evaluate(attacker, 1))
    assert figures["metrics-noise-std"] == pytest.approx(10 * release_sensitivity(10))
    entries = attacker.ledger().entries
    assert entries == [Selection(RATIO * EPSILON, 1, 1), GaussianSteps(10.0, 1.0, 1, 1)]
    # the spend composes both: at least the selection's own, within the budget
    assert attacker.spent() > RATIO * EPSILON
    rdp = PrivacyLedger().rdp(entries)
    orders = np.asarray(PrivacyLedger().orders)
    np.testing.assert_allclose(rdp, selection_rdp(RATIO * EPSILON, orders) + orders / 200)
    attacker.assert_within_budget()


def test_a_training_plan_and_a_majority_round_do_not_mix_in_one_run(tmp_path,
                                                                      server_task_identity):
    attacker = Attacker(tmp_path, _node_config(tmp_path, metrics="exact"))
    assert not attacker.train(1, cluster=-2, **_schedule(select_rounds=1, select_ratio=RATIO,
                                                         first_batch=32)).has_error()
    reply = _train(attacker, 2)
    assert reply.has_error() and "changed the DP schedule" in reply.error.reason
    assert len(attacker.ledger().entries) == 1


def test_the_server_drops_a_majority_reply_without_a_class_of_the_run_or_with_an_update(
        server_task_identity):
    layout = ModelLayout(["w"], [(3,)])

    def reply(fields: dict[str, Any], update: bool = False) -> Message:
        models = {UPDATE: pack(np.zeros(3, dtype=np.float32))} if update else None
        return Message(one_record(METRICS, {"cluster": MAJORITY, "epsilon-spent": 0.1,
                                            "noise-multiplier": 0.0, **fields}, models),
                       dst_node_id=5, message_type="train")

    checked = train_reply(reply({"majority-class": 1}), layout, 0, 1.0, 2)
    assert checked.cluster == MAJORITY and checked.update is None
    for fields in ({}, {"majority-class": 2}, {"majority-class": 0.5},
                   {"majority-class": -1}, {"majority-class": math.nan}):
        with pytest.raises(ValueError, match="must name a class 0..1"):
            train_reply(reply(fields), layout, 0, 1.0, 2)
    with pytest.raises(ValueError, match="trains nothing"):
        train_reply(reply({"majority-class": 0}, update=True), layout, 0, 1.0, 2)


# --- a whole run ---------------------------------------------------------------------------------
SILOS, FEATURES, RECORDS = 3, 4, 400
SHARES = [0.15, 0.3, 0.8]  # each silo's share of class 1


def _silo(tmp_path: Path, partition: int, run_config: dict[str, Any]) -> Context:
    rng = np.random.default_rng(partition)
    y = (rng.random(RECORDS) < SHARES[partition]).astype(np.int64)
    x = rng.normal(size=(RECORDS, FEATURES)).astype(np.float32)
    path = tmp_path / f"silo-{partition}.npz"
    np.savez(path, x=x, y=y)
    schema = tmp_path / "schema.toml"
    schema.write_text(f'input-shape = "{FEATURES}"\nnum-classes = 2\n')
    node = {"partition-id": partition, "epsilon": 8.0, "delta": 1e-4, "schema-file": str(schema),
            "ledger-path": str(tmp_path / f"silo-{partition}" / "ledger.json"),
            "data-source": "arrays", "data-seed": partition, "metrics": "exact",
            "data-path": str(path)}
    return Context(run_id=1, node_id=800 + partition, node_config=node, state=RecordDict(),
                   run_config=run_config)


def test_a_majority_run_gives_each_silo_its_class_and_the_tables_its_figures(
        tmp_path, server_task_identity):
    experiment = parse_run_config({
        "method": "majority", "clusters": str(SILOS), "model": "mlp",
        "input-shape": str(FEATURES), "num-classes": 2, "num-server-rounds": 3,
        "eval-every": 1, "out-dir": str(tmp_path / "run"), "tensorboard": False,
        "wait-for-clients": 5.0})
    contexts = {800 + p: _silo(tmp_path, p, experiment.to_run_config()) for p in range(SILOS)}
    grid = GridDouble({node: (lambda message, c=context: client_app(message, c))
                       for node, context in contexts.items()})
    results = run_experiment(grid, experiment)
    assert results["complete"]
    assert [row["trained"] for row in results["rounds"]] == [SILOS, 0, 0]  # one round each
    for client in results["clients"]:
        p = client["partition"]
        context = contexts[800 + p]
        data = Silo(parse_node_config(context.node_config), experiment, 1).data
        train_labels, test_labels = data.y_train.numpy(), data.y_test.numpy()
        label = int(np.argmax(np.bincount(train_labels, minlength=2)))
        assert client["majority_class"] == label == int(SHARES[p] > 0.5)
        assert client["final_cluster"] == MAJORITY
        assert client["test_accuracy"] == pytest.approx(np.mean(test_labels == label))
        assert client["test_balanced_accuracy"] == pytest.approx(
            balanced_accuracy_score(test_labels, np.full_like(test_labels, label))) == 0.5
        assert client["test_auroc"] == 0.5  # one score for every record
        ledger = PrivacyLedger.load(context.node_config["ledger-path"])
        assert ledger.entries == [Selection(RATIO * 8.0, 1, 1)]
        assert client["epsilon_spent"] == pytest.approx(
            ledger.spent(PrivacyBudget(8.0, 1e-4)))
        assert client["noise_multiplier"] == 0.0
    summary = results["summary"]
    assert summary["mean_balanced_accuracy"] == 0.5 and summary["mean_auroc"] == 0.5
    assert summary["mean_accuracy"] == pytest.approx(
        np.mean([c["test_accuracy"] for c in results["clients"]]))
    assert summary["mean_accuracy"] > 0.7  # the skew that balanced accuracy sees through
    with (tmp_path / "run" / "rounds.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["mean_test_balanced_accuracy"]) for r in rows] == [0.5] * 3
    assert [float(r["mean_test_auroc"]) for r in rows] == [0.5] * 3
    console = Console(record=True, width=100)
    console.print(summary_table(results))
    text = console.export_text()
    assert "mean balanced accuracy" in text and "50.0%" in text and "mean AUROC" in text
