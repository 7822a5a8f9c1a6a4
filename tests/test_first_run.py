"""The default path on records exported to files: a run config with only the schema, the
method and the budget (no learning rate, no M) trains a model that beats the majority class,
finds the groups the server was not told, and charges the learning-rate choice to every
silo's ledger (docs/algorithm.md#choosing-the-learning-rate, #choice-of-m)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from dpcfl_flwr.config.settings import STEP_LENGTHS, parse_run_config
from dpcfl_flwr.data import Topology, load_dataset, make_client_data
from dpcfl_flwr.data.partition import normalisation
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.schedule import round_phase, two_stage_schedule

GROUPS = (3, 3)
TRAIN, TEST = 500, 200


def _raw(x):
    """The benchmark's normalised images as stored raw: 0..255 pixels."""
    (mean,), (std,) = normalisation("fmnist")
    return np.clip(np.rint((x.numpy() * std + mean) * 255), 0, 255).astype(np.uint8)


@pytest.mark.slow
def test_a_run_config_of_schema_method_and_budget_learns_on_raw_exported_records(tmp_path):
    from dpcfl_flwr.runs.simulation import run_simulation

    train, test = load_dataset("fmnist", None)
    labels = []
    for i in range(sum(GROUPS)):
        data = make_client_data(train, test, i, Topology(GROUPS), "rotation", TRAIN, seed=0,
                                test_samples=TEST)
        np.savez(tmp_path / f"silo-{i}.npz", x_train=_raw(data.x_train),
                 y_train=data.y_train.numpy(), x_val=_raw(data.x_val),
                 y_val=data.y_val.numpy(), x_test=_raw(data.x_test),
                 y_test=data.y_test.numpy())
        labels.append((data.y_train.numpy(), data.y_test.numpy()))
    out = tmp_path / "run"
    experiment = parse_run_config({
        "method": "rdpcfl", "epsilon": 10.0, "input-shape": "1,28,28", "num-classes": 10,
        "data-source": "arrays", "silo-data-paths": str(tmp_path / "silo-{partition}.npz"),
        "clusters": "3,3", "num-server-rounds": 8, "eval-every": 8, "out-dir": str(out)})
    run_simulation(experiment, cpus=2)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True
    clustering = results["clustering"]
    assert clustering["n_clusters"] == 2 and clustering["ari"] == 1.0

    candidates = [length / 3.0 for length in STEP_LENGTHS]
    majority = np.mean([np.mean(te == Counter(tr.tolist()).most_common(1)[0][0])
                        for tr, te in labels])
    accuracies = [c["test_accuracy"] for c in results["clients"]]
    assert np.mean(accuracies) > majority + 0.3, (accuracies, majority)
    votes = Counter(c["learning_rate"] for c in results["clients"])
    assert results["learning_rate"] == max(votes, key=lambda r: (votes[r], r))
    for client in results["clients"]:
        assert any(np.isclose(client["learning_rate"], c) for c in candidates)
        # the plan holds the choice: 3 more rounds of steps and one more selection than the
        # same run with a set learning rate (an independent calibration of the same schedule)
        phases = (two_stage_schedule(TRAIN, 32, 1, 8, "full")
                  + [round_phase(TRAIN, 32, 1, len(candidates) - 1)])
        select_rounds = max(1, int(0.1 * 8))
        z = plan_noise(phases, 10.0, 1e-4, select_rounds + 1, 0.03).noise_multiplier
        assert client["noise_multiplier"] == pytest.approx(z, rel=1e-6)
        assert client["epsilon_spent"] <= 10.0
