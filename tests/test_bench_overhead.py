"""The overhead bench's packing floor: a true lower bound on a round's makespan, and tight for
the simulation's case of near-equal silos; its deployed silos report the CPU seconds the
overhead is measured against; and repeated runs report each round's medians."""

from __future__ import annotations

import itertools
import random
import subprocess
from pathlib import Path

import pytest

from bench.overhead import opt_in_cpu_seconds, packing_bound, round_figures, rows
from dpcfl_flwr.deploy.localhost import DPCFL
from dpcfl_flwr.deploy.silo_file import deployed_settings, load_silo_file


def optimal_makespan(times: list[float], workers: int) -> float:
    """Brute force: every assignment of jobs to workers (jobs run to the end, one at a time)."""
    best = float("inf")
    for assignment in itertools.product(range(workers), repeat=len(times)):
        loads = [0.0] * workers
        for job, worker in zip(times, assignment, strict=True):
            loads[worker] += job
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_bound_never_exceeds_the_best_schedule(seed: int) -> None:
    rng = random.Random(seed)
    workers = rng.choice([2, 3])
    times = [rng.uniform(0.5, 1.5) for _ in range(rng.randint(1, 9 if workers == 2 else 7))]
    assert packing_bound(times, workers) <= optimal_makespan(times, workers) + 1e-9


def test_equal_silos_on_two_workers_need_the_larger_half() -> None:
    # 21 silos of 0.5 s on 2 workers: 11 back to back, not 10.5.
    assert packing_bound([0.5] * 21, 2) == pytest.approx(5.5)
    assert optimal_makespan([0.5] * 7, 2) == pytest.approx(packing_bound([0.5] * 7, 2))


def test_one_long_job_sets_the_floor() -> None:
    assert packing_bound([5.0, 1.0, 1.0], 2) == pytest.approx(5.0)
    assert packing_bound([1.0, 1.0, 1.0, 1.0], 2) == pytest.approx(2.0)


def test_opted_in_silo_files_report_cpu_seconds(tmp_path: Path) -> None:
    """The files `dpcfl topology silos` writes leave the silo's CPU seconds out (a deployed
    silo's default); after the bench's opt-in, each one resolves to reporting them."""
    subprocess.run([*DPCFL, "topology", "silos", "--clusters", "1,2", "--out", str(tmp_path),
                    "--superlink", "127.0.0.1:9"], check=True, capture_output=True)
    files = sorted(tmp_path.glob("silo-*.toml"))
    assert len(files) == 3

    def reports(path: Path) -> bool | None:
        return deployed_settings(load_silo_file(path, {}, {})[1]).report_cpu_seconds

    assert not any(reports(path) for path in files)
    opt_in_cpu_seconds(tmp_path)
    assert all(reports(path) for path in files)


def test_opting_in_refuses_a_file_whose_last_table_is_not_node(tmp_path: Path) -> None:
    (tmp_path / "silo-00.toml").write_text('name = "a"\n[node]\nepsilon = 1.0\n[extra]\n')
    with pytest.raises(SystemExit, match="last table"):
        opt_in_cpu_seconds(tmp_path)


def _results(walls: list[float], silo_seconds: list[list[float]]) -> dict:
    """A run's results.json as the bench reads it: rounds with their wall and silos' CPU."""
    return {"rounds": [
        {"round": i + 1, "stage": "soft", "seconds": wall,
         "client_cpu_seconds": sum(cpu), "silo_cpu_seconds": dict(enumerate(cpu))}
        for i, (wall, cpu) in enumerate(zip(walls, silo_seconds, strict=True))]}


def test_repeated_runs_report_each_rounds_median_and_the_range_of_its_overhead() -> None:
    # three runs of two rounds, each silo 1 s of CPU on 2 workers: a round of 2 silos has a
    # floor of 1 s, so a wall of 1.25 s is 20% overhead
    cpu = [[1.0, 1.0], [1.0, 1.0]]
    runs = [round_figures("simulation", _results(walls, cpu), True)
            for walls in ([1.0, 1.25], [1.1, 1.0], [2.0, 1.6])]
    lines, mean, beyond = rows("simulation", runs)
    # round 2's overheads: 20%, 0%, 37.5% -> median 20%; walls 1.25, 1.0, 1.6 -> 1.25
    assert lines[1] == "| simulation | 2 (soft) | 1.2 | 2.0 | 1.0 | 1.0 | 20% | 20% | 0-38% |"
    assert mean == pytest.approx(0.2) and beyond == pytest.approx(0.2)
    assert lines[0].endswith("| 9% | 9% | 0-50% |")  # 0%, 9.1%, 50%
    single, mean_one, _ = rows("simulation", runs[:1])
    assert single[1] == "| simulation | 2 (soft) | 1.2 | 2.0 | 1.0 | 1.0 | 20% | 20% |"
    assert mean_one == pytest.approx(0.2)
