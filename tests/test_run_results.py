"""What a run's results say about figures the silos did not give at the end: a silo that
dropped out keeps an earlier evaluation, which is marked stale and left out of the means; a
silo that joined with budget spent in earlier runs is named, with its larger noise; and a
topology of equal clusters has no minority."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Error, Message
from rich.console import Console

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.protocol import METRICS, SILO, SILO_FAILED, ModelLayout
from dpcfl_flwr.results.recorder import (
    RunRecorder,
    minority_cluster,
    structure_found,
    unused_results_directory,
)
from dpcfl_flwr.runs.progress import summary_table
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import build_strategy

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

DROPS_AFTER = 2  # the dropping silo's last answered round
USUAL_Z, SPENT_Z, SPENT_BEFORE = 1.06, 1.88, 9.0


class SiloWithUsualNoise(ScriptedSilo):
    def __call__(self, message: Message) -> Message:
        reply = super().__call__(message)
        if message.metadata.message_type == "train":
            reply.content[METRICS]["noise-multiplier"] = USUAL_Z
        return reply


class SiloThatDrops(SiloWithUsualNoise):
    """Answers like a scripted silo up to round DROPS_AFTER, then fails every message."""

    def __call__(self, message: Message) -> Message:
        config = message.content.config_records.get("config")
        if config is not None and int(config["server-round"]) > DROPS_AFTER:
            return Message(Error(SILO_FAILED, "the silo went away"), reply_to=message)
        return super().__call__(message)


class SiloWithSpentBudget(ScriptedSilo):
    """A silo whose ledger holds SPENT_BEFORE of its 10 from an earlier run: it says so when
    queried and trains with the larger z that the rest of its budget implies."""

    def __call__(self, message: Message) -> Message:
        reply = super().__call__(message)
        kind = message.metadata.message_type
        if kind == "query":
            reply.content[SILO]["epsilon-spent"] = SPENT_BEFORE
        elif kind == "train":
            reply.content[METRICS]["noise-multiplier"] = SPENT_Z
        return reply


def _run(tmp_path, silos: dict[int, type[ScriptedSilo]], rounds: int = 4,
         default: type[ScriptedSilo] | None = None, **run: object
         ) -> tuple[dict, dict[str, str]]:
    """A run of ``rounds`` (evaluated every 2) with the given silo kinds (the others
    ``default``'s, else training with z = USUAL_Z): its results and its summary table's
    rows."""
    experiment = parse_run_config({"method": "global", "clusters": "2,3,3",
                                   "num-server-rounds": rounds, "eval-every": 2,
                                   "out-dir": str(tmp_path), **run})
    initial = initial_arrays(experiment)
    recorder = RunRecorder(tmp_path, experiment)
    strategy = build_strategy(experiment, initial, observer=recorder)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    grid = GridDouble({NODE + p: silos.get(p, default or SiloWithUsualNoise)(p, layout, centres)
                       for p in range(len(TRUTH))})
    strategy.discover(grid, len(TRUTH), 1)
    strategy.start(grid, initial, rounds, timeout=10)
    results = recorder.finish(strategy)
    return results, _rows(results)


def _rows(results: dict) -> dict[str, str]:
    console = Console(record=True, width=160)
    console.print(summary_table(results))
    cells = [[cell.strip() for cell in line.split("│")[1:-1]]
             for line in console.export_text().splitlines() if line.count("│") == 3]
    return dict((label, value) for label, value in cells)


def test_a_silo_that_dropped_out_is_marked_stale_and_left_out_of_the_means(
        server_task_identity, tmp_path):
    dropped = 3
    results, table = _run(tmp_path, {dropped: SiloThatDrops})
    clients = {c["partition"]: c for c in results["clients"]}
    assert clients[dropped]["dropped_rounds"] == [3, 4]
    assert clients[dropped]["test_accuracy"] is not None  # its round-2 figure, kept ...
    assert clients[dropped]["evaluated_round"] == DROPS_AFTER and clients[dropped]["stale"]
    assert all(c["evaluated_round"] == 4 and not c["stale"]
               for p, c in clients.items() if p != dropped)
    summary = results["summary"]
    # ... but not averaged: the means are over the silos evaluated at round 4
    fresh = results["rounds"][-1]["test_accuracy"]
    assert dropped not in fresh and len(fresh) == len(TRUTH) - 1
    assert summary["mean_accuracy"] == pytest.approx(np.mean(list(fresh.values())))
    minority = [a for p, a in fresh.items() if TRUTH[int(p)] == 0]
    assert summary["minority_accuracy"] == pytest.approx(np.mean(minority))
    assert summary["silos_evaluated"] == len(TRUTH) - 1 and summary["silos"] == len(TRUTH)
    assert summary["evaluated_round"] == 4 and summary["stale_silos"] == {str(dropped): 2}
    assert table["mean test accuracy"].endswith(f"% ({len(TRUTH) - 1} of {len(TRUTH)} "
                                                "silos, round 4)")
    assert table["stale (not in the means)"] == f"silo {dropped} (round {DROPS_AFTER})"


def test_budget_spent_before_the_run_is_logged_once_and_reported(server_task_identity,
                                                                   tmp_path, caplog):
    spent = 2
    with caplog.at_level(logging.WARNING):
        results, table = _run(tmp_path, {spent: SiloWithSpentBudget}, rounds=3)
    lines = [r.getMessage() for r in caplog.records]
    starts = [line for line in lines if "already spent" in line]
    assert starts == [f"silo {spent} starts with eps 9 of 10 already spent (earlier runs): "
                      "this run can use the 1 left, with larger noise"]
    noisier = [line for line in lines if "noise multiplier" in line]
    assert noisier == [f"round 1: silo {spent} trains with noise multiplier z=1.88, "
                       f"{len(TRUTH) - 1} other silo(s) with 1.06 (its budget eps 10, 9 "
                       "spent before this run; 100 training records)"]
    clients = {c["partition"]: c for c in results["clients"]}
    assert clients[spent]["epsilon_spent_before_run"] == SPENT_BEFORE
    assert all(c["epsilon_spent_before_run"] == 0.0 for p, c in clients.items() if p != spent)
    assert results["summary"]["spent_before_run"] == {str(spent): SPENT_BEFORE}
    assert table["spent before the run"] == f"silo {spent}: 9 of 10"


def test_silos_with_the_same_noise_and_no_earlier_spend_are_not_mentioned(
        server_task_identity, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        results, table = _run(tmp_path, {}, rounds=2)
    assert "already spent" not in caplog.text and "noise multiplier" not in caplog.text
    assert results["summary"]["spent_before_run"] == {} and not results["summary"]["stale_silos"]
    assert table["spent before the run"] == "none"
    assert "stale (not in the means)" not in table


@pytest.mark.parametrize(("sizes", "minority"), [
    ((3, 6, 6, 6), 0), ((2, 3, 3), 0), ((5, 2, 2), None), ((2, 2), None), ((2, 2, 6), None),
    ((4,), None), ((6, 6, 3), 2)])
def test_the_minority_is_the_one_cluster_smaller_than_every_other(sizes, minority):
    truth = dict(enumerate(c for c, size in enumerate(sizes) for _ in range(size)))
    assert minority_cluster(truth) == minority
    exact, isolated = structure_found(truth, truth)
    assert exact and isolated == (None if minority is None else True)


def test_equal_clusters_have_no_minority_in_the_summary(server_task_identity, tmp_path):
    results, table = _run(tmp_path, {}, rounds=2)
    assert results["summary"]["minority_cluster"] == 0  # {2, 3, 3}: cluster 0 is smaller
    assert "minority (cluster 0) accuracy" in table and "majority accuracy" in table
    results["summary"].update(minority_cluster=None, minority_accuracy=None)  # as for {2, 2}
    table = _rows(results)
    assert table["minority accuracy"] == "none (no cluster smaller than the others)"
    assert "majority accuracy" not in table


class SiloOfAnUnknownGroup(SiloWithUsualNoise):
    """A silo on its own records whose operator set no true-cluster."""

    def __call__(self, message: Message) -> Message:
        reply = super().__call__(message)
        if message.metadata.message_type == "query":
            reply.content[SILO]["true-cluster"] = -1
        return reply


def test_unknown_true_groups_get_no_ari_or_structure_verdict(server_task_identity, tmp_path):
    """Where the true groups are unknown, an ARI against them would read as 'no structure
    found'; the results and the table say the groups are unknown instead."""
    known, _ = _run(tmp_path / "known", {}, 2, None, method="rdpcfl",
                    **{"rdpcfl.n-clusters": 3})
    assert {"ari", "final_ari", "found_structure"} <= set(known["clustering"])
    results, table = _run(tmp_path / "unknown", {}, 2, SiloOfAnUnknownGroup,
                          method="rdpcfl", **{"rdpcfl.n-clusters": 3})
    assert results["clustering"]["n_clusters"] == 3
    assert not {"ari", "final_ari", "found_structure", "minority_isolated"} & set(
        results["clustering"])
    assert table["true groups"].startswith("unknown") and "ARI round 1" not in table


def test_a_new_run_never_writes_into_an_earlier_runs_results_directory(tmp_path):
    # a deployment submits the same out-dir every time (compose.yaml's /results/laptop-run)
    out = tmp_path / "laptop-run"
    assert unused_results_directory(out) == out  # absent
    out.mkdir()
    (out / "notes.txt").write_text("the operator's")
    assert unused_results_directory(out) == out  # no run wrote there
    (out / "progress.jsonl").write_text("")  # a run started there, complete or not
    assert unused_results_directory(out) == tmp_path / "laptop-run-2"
    (tmp_path / "laptop-run-2").mkdir()
    (tmp_path / "laptop-run-2" / "results.json").write_text("{}")
    assert unused_results_directory(str(out)) == tmp_path / "laptop-run-3"
