"""The overhead benchmark's /proc sampler: it must see the CPU of the processes a benchmark
starts, and place rounds in time from the run's progress file."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench.process_cpu import DRIVER, SAMPLER, STOLEN, ProcessCpuSampler, role_of

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_child_cpu_is_counted_and_rounds_are_placed(tmp_path):
    progress = tmp_path / "progress.jsonl"
    with ProcessCpuSampler(progress, interval=0.05) as sampler:
        start = time.time()
        subprocess.run([sys.executable, "-c", BURN.format(seconds=0.6)], check=True)
        end = time.time()
        progress.write_text(json.dumps({"event": "round", "round": 2,
                                        "seconds": end - start}) + "\n")
        time.sleep(0.3)
    by_role = sampler.cpu_between(*sampler.round_window(2))
    # The child burned 0.6 s of CPU; at most one 50 ms sample of it can fall outside.
    assert 0.45 <= by_role.get("other", 0.0) <= 0.8
    assert by_role.get(DRIVER, 0.0) < 0.3  # this process mostly waited
    assert by_role[STOLEN] >= 0.0
    started, finished = sampler.round_window(2)
    assert finished - started == pytest.approx(end - start)
    assert 0.0 <= finished - end < 0.5



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rounds_window_leaves_out_the_evaluation_that_follows_it(tmp_path):
    # A round that evaluates is reported once its evaluation is done: its training ended
    # evaluate_seconds before. Here the training waits and the evaluation burns CPU.
    progress = tmp_path / "progress.jsonl"
    with ProcessCpuSampler(progress, interval=0.05) as sampler:
        start = time.time()
        time.sleep(0.6)
        trained = time.time()
        subprocess.run([sys.executable, "-c", BURN.format(seconds=0.6)], check=True)
        evaluated = time.time()
        progress.write_text(json.dumps({"event": "round", "round": 2, "seconds": trained - start,
                                        "evaluate_seconds": evaluated - trained}) + "\n")
        time.sleep(0.3)
    started, finished = sampler.round_window(2)
    assert 0.0 <= finished - trained < 0.5 and finished - started == pytest.approx(
        trained - start)
    assert sampler.cpu_between(started, finished).get("other", 0.0) < 0.2  # not the burn


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_samplings_own_cpu_is_its_own_row_not_the_drivers():
    """The sampler runs in the driver's process: its reading of /proc is CPU the measured run
    does not get, so it is reported apart, and the driver's row is the driver's own work
    (here none: it sleeps while the sampler reads /proc without pause)."""
    with ProcessCpuSampler(interval=0.0) as sampler:
        time.sleep(0.2)
        start = time.time()
        time.sleep(1.0)
        end = time.time()
        time.sleep(0.2)
    by_role = sampler.cpu_between(start, end)
    assert by_role[SAMPLER] > 0.1, by_role
    assert abs(by_role[DRIVER]) < 0.05, by_role  # /proc counts in 10 ms ticks

def test_roles_follow_the_command_line():
    assert role_of("python -m dpcfl_flwr.flower_compat.warm_runtime --runtime-api-address x") == (
        "ClientApp runtimes")
    assert role_of("python -m dpcfl_flwr.deploy.supernode_launcher --idle-poll 0.5") == (
        "SuperNodes")
    assert role_of("/venv/bin/flower-superlink --fleet-api-address x") == "SuperLink"
    assert role_of("/venv/bin/python /venv/bin/dpcfl client clients/silo-00.toml") == (
        "dpcfl supervisors")
    assert role_of('/venv/bin/python -m dpcfl_flwr.deploy.silo_supervisor {"command": []}') == (
        "dpcfl supervisors")  # what `dpcfl client` becomes once its checks are done
    assert role_of("ray::ClientAppActor.run") == "Ray workers"
    assert role_of("sleep 5") == "other"
