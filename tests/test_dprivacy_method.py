"""The d-privacy method (paper 004, Alg. 1) through the real ClientApp and the server's
method: a silo privatises as its own config says, releases sanitised models whose leakage its
ledger keeps apart from (epsilon, delta)-DP, refuses past its leakage budget, picks the
hypothesis that fits its data; the server clusters the released models with k-means."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from dpcfl_flwr.client_app import app as client_app
from dpcfl_flwr.config.settings import ConfigError, parse_node_config, parse_run_config
from dpcfl_flwr.methods.base import ServerState, TrainReply
from dpcfl_flwr.methods.dprivacy import DPrivacyCFL
from dpcfl_flwr.privacy.ledger import PrivacyLedger
from dpcfl_flwr.protocol import (
    ARRAYS,
    BAD_REQUEST,
    BUDGET_EXCEEDED,
    CONFIG,
    SELECT,
    UPDATE,
    ModelLayout,
    cluster_key,
    metrics_of,
    model_records,
)
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.silo.silo import Silo

from .test_silo import _context, _message

N = 80


def _experiment(tmp_path, **keys):
    return parse_run_config({"method": "dprivacy", "clusters": "1,1", "samples-per-client": N,
                             "test-samples": 40, "num-server-rounds": 4,
                             "dprivacy.noise-multiplier": 2.0, "out-dir": str(tmp_path / "run"),
                             **keys})


def _train(experiment, server_round, cluster, models, privatiser="dprivacy"):
    method = DPrivacyCFL(experiment, experiment.params, ServerState(np.zeros(1, np.float32)))
    config = {"server-round": server_round, "stage": "x", "cluster": cluster,
              "round-batch": "16", "learning-rate": 0.05, "clip-norm": 1.0,
              **method.schedule().to_config(), "privatiser": privatiser}
    content = RecordDict({CONFIG: ConfigRecord(config)})
    if cluster == SELECT:
        for m, record in enumerate(models):
            content[cluster_key(m)] = record
    else:
        content[ARRAYS] = models[0]
    return _message(content, "train", 501)


@pytest.fixture()
def simulation(monkeypatch):
    monkeypatch.setattr("dpcfl_flwr.client_app.running_in_simulation", lambda: True)


def test_robust_hdp_weights_are_refused_with_d_privacy(tmp_path):
    with pytest.raises(ConfigError, match="combines its updates its own way"):
        _experiment(tmp_path, aggregation="robust-hdp")


def test_a_deployed_d_privacy_silo_must_set_its_own_noise_and_budget(tmp_path):
    node = parse_node_config({"partition-id": 0, "epsilon": 1.0, "delta": 1e-5,
                              "ledger-path": str(tmp_path / "l.json"),
                              "privatiser": "dprivacy", "dprivacy-noise": 1.0})
    with pytest.raises(ConfigError, match="dprivacy-leakage-budget"):
        node.resolved(_experiment(tmp_path), trust_run_config=False)
    silo = Silo(parse_node_config({"partition-id": 1}), _experiment(tmp_path), 7,
                trust_run_config=True)  # simulation: the method's table
    assert (silo.silo.privatiser, silo.silo.dprivacy_noise) == ("dprivacy", 2.0)


def test_a_dp_sgd_silo_refuses_to_release_a_plainly_trained_model(server_task_identity,
                                                                 simulation, tmp_path):
    experiment = parse_run_config({"clusters": "1,1", "samples-per-client": N,
                                   "out-dir": str(tmp_path / "run")})
    model = initial_arrays(experiment)
    answer = client_app(_train(experiment, 1, 0, [model]), _context(experiment))
    assert answer.has_error() and answer.error.code == BAD_REQUEST
    assert "privatises with 'dpsgd'" in answer.error.reason
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert ledger.entries == []  # nothing charged


def test_a_silo_releases_sanitised_models_and_stops_at_its_leakage_budget(
        server_task_identity, simulation, tmp_path):
    n = ModelLayout.of(initial_arrays(_experiment(tmp_path))).size
    experiment = _experiment(tmp_path, **{"dprivacy.leakage-budget": 2.5 * n / 2.0})
    context, model = _context(experiment), initial_arrays(experiment)
    layout = ModelLayout.of(model)
    good = model  # a hypothesis that has learnt something fits better than a wrecked one
    wrecked = initial_arrays(experiment)
    for name in wrecked:
        wrecked[name] = type(wrecked[name])(wrecked[name].numpy() * 0 + 5.0)
    first = client_app(_train(experiment, 2, SELECT, [wrecked, good]), context)
    metrics = metrics_of(first)
    assert metrics["cluster"] == 1  # the lowest loss on its own records
    update = layout.flatten(model_records(first.content)[UPDATE])
    assert np.isfinite(update).all() and np.abs(update).sum() > 0
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert [e.kind for e in ledger.entries] == ["dprivacy"]
    assert ledger.entries[0].leakage == pytest.approx(n / 2.0)
    assert metrics["dprivacy-leakage"] == pytest.approx(n / 2.0)
    assert metrics["epsilon-spent"] == 0.0  # nothing of (epsilon, delta)-DP was spent
    second = client_app(_train(experiment, 3, 0, [good]), context)
    assert not second.has_error()
    third = client_app(_train(experiment, 4, 0, [good]), context)
    assert third.has_error() and third.error.code == BUDGET_EXCEEDED
    assert "d-privacy leakage would reach" in third.error.reason
    ledger = PrivacyLedger.load(experiment.ledger_directory() / "silo-1.json")
    assert len(ledger.entries) == 2 and ledger.dprivacy_leakage() == pytest.approx(n)


def test_the_server_clusters_released_models_with_k_means_and_keeps_an_empty_hypothesis(
        tmp_path):
    experiment = _experiment(tmp_path, **{"dprivacy.n-clusters": 3})
    state = ServerState(np.zeros(4, np.float32))
    method = DPrivacyCFL(experiment, experiment.params, state)
    state.models = [np.array(v, np.float32) for v in ([0, 0, 0, 0], [10, 0, 0, 0],
                                                      [50, 50, 50, 50])]
    assert method.assign(1, [0, 1]) != {0: -1, 1: -1}  # round 1: drawn, not chosen
    assert method.assign(2, [0, 1]) == {0: SELECT, 1: SELECT}
    rng = np.random.default_rng(0)
    near = {0: 0, 1: 0, 2: 1, 3: 1}  # partition -> hypothesis its released model is near
    replies = {p: TrainReply(0, (state.models[h] - state.models[0] + rng.normal(
        0, 0.1, 4)).astype(np.float32), {}) for p, h in near.items()}
    method.absorb(2, replies)
    assert {p: method.current_cluster(p) for p in near} == near
    assert state.models[2].tolist() == [50, 50, 50, 50]  # nobody near it: kept
    assert np.allclose(state.models[1], [10, 0, 0, 0], atol=0.2)
