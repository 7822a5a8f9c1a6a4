"""Finding the silos that can run, before any trains: a silo that cannot start is named once,
and too few silos stop the run with one error instead of a run that never ends."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from rich.console import Console

from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.protocol import METRICS, NOT_ANSWERED, SILO_FAILED, ModelLayout, one_record
from dpcfl_flwr.results.recorder import RunRecorder
from dpcfl_flwr.runs.progress import describe_round, summary_table
from dpcfl_flwr.server_app import initial_arrays
from dpcfl_flwr.strategies import TooFewSilos, build_strategy, silos
from dpcfl_flwr.strategies.exchange import RunInterrupted, exchange, stop_requested

from .grid_double import GridDouble
from .scripted_silos import NODE, TRUTH, ScriptedSilo

BROKEN = "DataError: data/train-labels-idx1-ubyte.gz: corrupt or truncated gzip data"


class SiloThatCannotStart(ScriptedSilo):
    """Silos in ``broken`` answer every message with the error a silo whose data file is
    truncated sends; the others are scripted silos."""

    broken: frozenset[int] = frozenset()
    reason = BROKEN

    def __call__(self, message: Message) -> Message:
        if self.partition in self.broken:
            return Message(Error(SILO_FAILED, self.reason), reply_to=message)
        return super().__call__(message)


def _setup(broken: set[int], method: str = "global", **extra):
    experiment = parse_run_config({
        "method": method, "clusters": "2,3,3", "num-server-rounds": 3,
        **{f"{m}.n-clusters": 3 for m in ("rdpcfl", "ifca", "km")},
        "eval-every": 3, "out-dir": "unused", **extra})
    initial = initial_arrays(experiment)
    strategy = build_strategy(experiment, initial)
    layout = ModelLayout.of(initial)
    centres = np.random.default_rng(0).normal(0, 1, (3, layout.size)).astype(np.float32)
    silo = type("Silo", (SiloThatCannotStart,), {"broken": frozenset(broken)})
    grid = GridDouble({NODE + p: silo(p, layout, centres) for p in range(len(TRUTH))})
    return experiment, strategy, grid, initial


def _cannot_start(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]


def test_a_run_where_no_silo_can_start_stops_at_once_with_one_error(server_task_identity,
                                                                     caplog):
    _, strategy, grid, _ = _setup(set(range(len(TRUTH))))
    started = time.monotonic()
    with pytest.raises(TooFewSilos) as stopped:
        strategy.discover(grid, expected=len(TRUTH), wait=600)
    assert time.monotonic() - started < 5  # every node answered: no reason to wait 600 s
    message = str(stopped.value)
    assert message.startswith(f"0 of {len(TRUTH)} silos can run ({len(TRUTH)} failed to start: "
                              f"{BROKEN} (nodes {NODE}, {NODE + 1}, {NODE + 2}, {NODE + 3} "
                              f"and {len(TRUTH) - 4} more))")
    assert message.endswith("at least 1 needed")
    assert len(_cannot_start(caplog)) == len(TRUTH)  # once per silo
    assert not grid.of_type("train") and len(grid.of_type("query")) == len(TRUTH)


def test_a_silo_that_cannot_start_is_named_once_and_asked_again_only_now_and_then(
        server_task_identity, caplog, monkeypatch):
    _, strategy, grid, initial = _setup({2, 5})
    strategy.discover(grid, expected=len(TRUTH), wait=600)
    assert sorted(strategy.silos) == [0, 1, 3, 4, 6, 7]
    assert "6 of 8 silos can run (2 failed to start" in caplog.text
    strategy.start(grid, initial, 3, timeout=10)
    assert len(_cannot_start(caplog)) == 2
    assert len(grid.of_type("query")) == len(TRUTH)  # not re-asked every round
    # After RETRY_FAILED_SECONDS the failed nodes are asked again; the same reason is not
    # logged again, a new one is.
    monkeypatch.setattr(silos, "RETRY_FAILED_SECONDS", 0.0)
    strategy.refresh_silos(grid)
    assert len(grid.of_type("query")) == len(TRUTH) + 2 and len(_cannot_start(caplog)) == 2
    grid.responders[NODE + 5].reason = "DataError: another problem"
    strategy.refresh_silos(grid)
    assert _cannot_start(caplog)[2:] == [f"silo on node {NODE + 5} cannot start: "
                                         "DataError: another problem"]


class SiloOfflineAtFirst(ScriptedSilo):
    """Silos in ``offline`` are first answered for by the SuperLink, with the reply Flower's
    link state makes for a node that went offline with the message queued (as after a
    SuperLink restart, until the silo's new session starts); then they answer themselves."""

    offline: frozenset[int] = frozenset()
    kind = "node_unavail"

    def __call__(self, message: Message) -> Message:
        if self.partition in self.offline and not getattr(self, "back", False):
            self.back = True
            return create_message_error_unavailable_res_message(message.metadata, self.kind)
        return super().__call__(message)


@pytest.mark.parametrize("kind", ["node_unavail", "msg_unavail"])
def test_a_node_the_superlink_answers_for_is_waited_for_not_counted_as_unable_to_start(
        server_task_identity, caplog, monkeypatch, kind):
    """Every node present has a reply, one of them the SuperLink's: the wait must not end
    there with that silo left out of the run, and nothing says it cannot start."""
    monkeypatch.setattr(silos, "RETRY_UNREACHABLE_SECONDS", 0.0)
    experiment, strategy, grid, _ = _setup(set())
    silo = type("Silo", (SiloOfflineAtFirst,), {"offline": frozenset({3}), "kind": kind})
    first = grid.responders[NODE]
    grid.responders[NODE + 3] = silo(3, first.layout, first.centres)
    with caplog.at_level(logging.INFO):
        strategy.discover(grid, experiment.expected_clients, wait=600)
    assert sorted(strategy.silos) == list(range(len(TRUTH)))
    assert not _cannot_start(caplog) and "can run" not in caplog.text
    assert f"node {NODE + 3} did not answer" in caplog.text
    assert len(grid.of_type("query")) == len(TRUTH) + 1


def test_the_codes_of_replies_the_superlink_writes_are_flowers():
    flowers = {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
               ErrorCode.NODE_UNAVAILABLE}
    assert flowers == NOT_ANSWERED


def test_required_clients_stop_a_run_with_too_few_silos_before_any_trains(
        server_task_identity):
    experiment, strategy, grid, _ = _setup({0, 1, 2}, **{"required-clients": 6})
    with pytest.raises(TooFewSilos, match=r"^5 of 8 silos can run \(3 failed to start: .*\); "
                                          r"at least 6 needed \(required-clients = 6\)$"):
        strategy.discover(grid, experiment.expected_clients, 600,
                          experiment.required_clients)
    assert not grid.of_type("train")
    _, strategy, grid, _ = _setup(set(), **{"required-clients": 9})
    with pytest.raises(TooFewSilos, match="the topology 2,3,3 has 8"):
        strategy.discover(grid, 8, 600, 9)
    assert not grid.sent


@pytest.mark.parametrize(("method", "broken", "needed"), [
    ("rdpcfl", {0, 1, 2, 3, 4}, 4), ("km", {0, 1, 2, 3, 4, 5}, 3)])
def test_a_clustering_method_stops_before_round_one_without_enough_silos(
        server_task_identity, method, broken, needed):
    """R-DPCFL with M = 3 clusters round 1's updates (M + 1 = 4 silos at least), k-means
    needs M; neither may let a silo spend budget on a round 1 it cannot cluster."""
    experiment, strategy, grid, _ = _setup(broken, method)
    survivors = len(TRUTH) - len(broken)
    with pytest.raises(TooFewSilos, match=rf"^{survivors} of 8 silos can run .*; at least "
                                          rf"{needed} needed \({method}.* needs {needed}\)$"):
        strategy.discover(grid, experiment.expected_clients, 600)
    assert not grid.of_type("train")


def test_a_stop_request_ends_the_servers_wait(server_task_identity):
    _, _, grid, _ = _setup(set())
    grid.responders = {}  # nobody answers: the exchange would wait for its timeout
    stop_requested.set()
    try:
        started = time.monotonic()
        with pytest.raises(RunInterrupted):
            exchange(grid, {0: Message(one_record(METRICS, {}), dst_node_id=NODE,
                                       message_type="train")}, timeout=60)
        assert time.monotonic() - started < 1
    finally:
        stop_requested.clear()


class SiloWithPrivateMetrics(ScriptedSilo):
    """Train replies without validation numbers, as a silo that keeps its metrics private."""

    def __call__(self, message: Message) -> Message:
        reply = super().__call__(message)
        if message.metadata.message_type == "train":
            record = reply.content[METRICS]
            for key in ("val-accuracy", "val-loss"):
                del record[key]
        return reply


def test_a_train_reply_without_validation_accuracy_is_used_and_shown_as_unknown(
        server_task_identity, tmp_path, caplog):
    experiment = parse_run_config({"method": "global", "clusters": "2,3,3",
                                   "num-server-rounds": 3, "eval-every": 3,
                                   "out-dir": str(tmp_path)})
    initial = initial_arrays(experiment)
    recorder = RunRecorder(tmp_path, experiment)
    strategy = build_strategy(experiment, initial, observer=recorder)
    layout = ModelLayout.of(initial)
    centres = np.zeros((3, layout.size), dtype=np.float32)
    grid = GridDouble({NODE + p: SiloWithPrivateMetrics(p, layout, centres)
                       for p in range(len(TRUTH))})
    with caplog.at_level(logging.WARNING):
        strategy.discover(grid, len(TRUTH), 1)
        strategy.start(grid, initial, 3, timeout=10)
    assert "cannot use" not in caplog.text
    assert all(len(r.trained) == len(TRUTH) and r.val_accuracy == {}
               for r in strategy.reports)
    results = recorder.finish(strategy)
    assert all(row["mean_val_accuracy"] is None for row in results["rounds"])
    assert "val acc -" in describe_round(results["rounds"][0])
    assert "nan" not in describe_round(results["rounds"][-1]).lower()
    results["summary"]["mean_accuracy"] = None  # e.g. every silo's noised accuracy unknown
    console = Console(record=True, width=120)
    console.print(summary_table(results))
    assert [line.split("│")[2].strip() for line in console.export_text().splitlines()
            if "mean test accuracy" in line] == [f"- ({len(TRUTH)} of {len(TRUTH)} silos, "
                                                 "round 3)"]
