"""Silos that differ: each calibrates its own noise for its own budget, batch size and record
count; the per-silo keys of a simulation give each silo its values; a server can ask a silo
to spend less (the minimum-epsilon baseline), never more; a lying silo's claim changes only
what the server is told."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.heterogeneity import per_silo_values
from dpcfl_flwr.config.paper_budgets import DISTRIBUTIONS, PAPER_BATCH_SIZES
from dpcfl_flwr.config.settings import ConfigError, parse_node_config, parse_run_config
from dpcfl_flwr.methods.base import SiloInfo
from dpcfl_flwr.privacy.ledger import PrivacyLedger
from dpcfl_flwr.protocol import CONFIG, SILO, metrics_of
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo.requests import TrainRequest
from dpcfl_flwr.silo.silo import Silo
from dpcfl_flwr.strategies import build_strategy

from .test_silo import _context, _message, _schedule, _train_content

N = 80


def _experiment(tmp_path, **keys):
    return parse_run_config({"clusters": "1,1", "samples-per-client": N, "test-samples": 40,
                             "num-server-rounds": 5, "epsilon": 4.0,
                             "out-dir": str(tmp_path / "run"), **keys})


def _silo(experiment, partition=1, **node):
    return Silo(parse_node_config({"partition-id": partition, **node}), experiment, 7,
                trust_run_config=True)


def test_a_preset_gives_silo_i_the_papers_value_i_and_repeats_past_twenty():
    assert per_silo_values("silo-epsilons", "Dist2", 20, float) == DISTRIBUTIONS["dist2"]
    batches = per_silo_values("silo-batch-sizes", "paper", 23, int)
    assert batches is not None and batches[:20] == PAPER_BATCH_SIZES
    assert batches[20:] == PAPER_BATCH_SIZES[:3]
    assert per_silo_values("silo-epsilons", "", 20, float) is None


@pytest.mark.parametrize(("keys", "message"), [
    ({"silo-epsilons": "1,2,3"}, "gives 3 values for 2 silos"),
    ({"silo-epsilons": "dist10"}, "preset (dist1"),
    ({"silo-batch-sizes": "32,0"}, "every value must be positive"),
    ({"silo-deltas": "1e-5,1.5"}, "every delta must be below 1"),
    ({"lying-silos": "0,5"}, "partitions [5] are not in 0..1"),
    ({"aggregation": "median"}, "not an aggregation rule"),
    ({"method": "local", "aggregation": "robust-hdp"}, "run config: method local combines"),
])
def test_a_bad_per_silo_key_stops_the_run_with_one_line(tmp_path, keys, message):
    with pytest.raises(ConfigError) as caught:
        _experiment(tmp_path, **keys)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_each_simulated_silo_takes_its_own_values_and_a_liar_only_claims_more(tmp_path):
    experiment = _experiment(tmp_path, **{"silo-epsilons": "2.5,0.7", "silo-deltas": "1e-5,1e-4",
                                          "silo-batch-sizes": "16,40", "silo-samples": "60,80",
                                          "lying-silos": "0", "lie-factor": 10})
    liar, honest = _silo(experiment, 0), _silo(experiment, 1)
    assert (liar.budget.epsilon, liar.budget.delta, liar.silo.batch_size) == (2.5, 1e-5, 16)
    assert (honest.budget.epsilon, honest.budget.delta, honest.silo.batch_size) == (0.7, 1e-4,
                                                                                     40)
    assert (liar.data.num_train, honest.data.num_train) == (60, 80)
    assert liar.describe()["epsilon-budget"] == 25.0  # what the server is told ...
    assert _experiment(tmp_path, **{"lying-silos": 1}).silo_overrides(1) == {
        "reported_epsilon": 40.0}  # a list of one arrives as a number
    assert honest.describe()["epsilon-budget"] == 0.7
    # ... while its noise is calibrated for, and its ledger bounded by, its real budget: the
    # same z as the same silo telling the truth
    truthful = _experiment(tmp_path / "truth", **{"silo-epsilons": "2.5,0.7",
                                                   "silo-deltas": "1e-5,1e-4",
                                                   "silo-batch-sizes": "16,40",
                                                   "silo-samples": "60,80"})
    assert liar.plan(_schedule(experiment)).noise_multiplier == pytest.approx(
        _silo(truthful, 0).plan(_schedule(truthful)).noise_multiplier)
    assert liar.budget.epsilon == 2.5
    # a silo's own file wins over the simulation's lists
    own = _silo(experiment, 1, epsilon=3.0, **{"batch-size": 20})
    assert (own.budget.epsilon, own.silo.batch_size) == (3.0, 20)


def test_a_silo_with_its_own_batch_plans_as_if_the_server_had_proposed_it(tmp_path):
    experiment = _experiment(tmp_path)
    proposed = _schedule(experiment)
    own = _silo(experiment, **{"batch-size": 16})
    assert own.own_schedule(proposed) == replace(proposed, batch_size=16)  # round 1 full
    single = replace(proposed, first_batch=proposed.batch_size)  # a baseline's schedule
    assert own.own_schedule(single) == replace(single, batch_size=16, first_batch=16)
    assert own.own_batch(proposed.batch_size, proposed) == 16
    assert own.own_batch("full", proposed) == "full"  # R-DPCFL's round 1 stays full-batch
    other = Silo(parse_node_config({"partition-id": 1}),
                 _experiment(tmp_path / "b", **{"batch-size": 16}), 7, trust_run_config=True)
    assert own.plan(own.own_schedule(proposed)).noise_multiplier == pytest.approx(
        other.plan(_schedule(other.experiment)).noise_multiplier)


def test_a_server_can_ask_for_less_epsilon_never_for_more(tmp_path):
    experiment = _experiment(tmp_path)
    schedule = _schedule(experiment)
    z_own = _silo(experiment, 0).plan(schedule).noise_multiplier
    z_low = _silo(experiment, 1).plan(replace(schedule, epsilon_target=1.0)).noise_multiplier
    low_budget = _experiment(tmp_path / "low", epsilon=1.0)
    assert z_low == pytest.approx(_silo(low_budget, 1).plan(
        _schedule(low_budget)).noise_multiplier)
    assert z_low > z_own
    greedy = _experiment(tmp_path / "greedy")
    z_high = _silo(greedy, 0).plan(replace(schedule, epsilon_target=40.0)).noise_multiplier
    assert z_high == pytest.approx(z_own)  # a target above the budget is ignored


def test_the_client_app_trains_with_its_own_batch_and_reports_it(server_task_identity,
                                                                 monkeypatch, tmp_path):
    monkeypatch.setattr("dpcfl_flwr.client_app.running_in_simulation", lambda: True)
    experiment = _experiment(tmp_path, **{"silo-batch-sizes": "8,20"})
    context = _context(experiment)
    query = client_app(_message(RecordDict({CONFIG: ConfigRecord({"server-round": 0})}),
                                "query", 501), context)
    assert query.content.metric_records[SILO]["batch-size"] == 20
    model = initial_arrays(experiment)
    first = metrics_of(client_app(_message(_train_content(experiment, 1, -2, [model]),
                                           "train", 501), context))
    second = metrics_of(client_app(_message(_train_content(experiment, 2, 0, [model]),
                                            "train", 501), context))
    assert (first["batch-size"], first["steps"]) == (N, 1)  # round 1: the full batch
    assert (second["batch-size"], second["steps"]) == (20, N // 20)
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert [(e.sample_rate, e.steps) for e in ledger.entries] == [(1.0, 1), (20 / N, N // 20)]


def test_min_eps_asks_every_silo_for_the_smallest_claimed_budget(tmp_path):
    experiment = _experiment(tmp_path, method="global", aggregation="min-eps",
                             **{"silo-epsilons": "3,0.5"})
    strategy = build_strategy(experiment, initial_arrays(experiment))
    strategy.silos.update({p: SiloInfo(p, 100 + p, 0, N, eps, 1e-4)
                           for p, eps in enumerate((3.0, 0.5))})
    config = strategy.train_config(2, 0)
    assert config["epsilon-target"] == 0.5
    assert _request(config).schedule.epsilon_target == 0.5
    strategy.silos[1].epsilon_budget = 0.1  # a later claim does not change the run's plan
    assert strategy.train_config(3, 0)["epsilon-target"] == 0.5
    assert np.isfinite(strategy.epsilon_target())


def _request(config):
    return TrainRequest.model_validate(config)


@pytest.mark.parametrize("first_batch", ["full", "server-b"])
def test_a_silo_with_its_own_batch_runs_its_whole_schedule_within_budget(tmp_path, first_batch):
    """Every round the silo runs, at the batch it runs it, is what it planned for: the whole
    run spends its budget (to the calibration's precision) and never more."""
    experiment = _experiment(tmp_path, **{"silo-batch-sizes": "64,64"})
    proposed = _schedule(experiment)
    if first_batch == "server-b":  # a single-stage baseline: every round at the server's b
        proposed = replace(proposed, first_batch=proposed.batch_size, select_rounds=0)
    silo = _silo(experiment)
    schedule = silo.own_schedule(proposed)
    plan = silo.plan(schedule)
    costs = [silo.round_cost(plan, silo.own_batch("full" if r == 1 and first_batch == "full"
                                                  else proposed.batch_size, proposed),
                             r, schedule.local_epochs) for r in range(1, proposed.rounds + 1)]
    assert {c.sample_rate for c in costs[1:]} == {64 / silo.data.num_train}
    spent = silo.ledger.epsilon(silo.budget.delta, silo.budget.conversion, costs)
    reserved = proposed.select_ratio * proposed.select_rounds * silo.budget.epsilon
    assert spent <= silo.budget.epsilon
    assert spent > 0.9 * (silo.budget.epsilon - reserved)
