"""CPU time of every process a benchmark starts, by role, sampled from /proc.

The overhead benchmark knows how much CPU the silos spent on their own work (``cpu-seconds``
in each reply) and how long a round took; this says where the rest went: which of the ~44
processes of a gRPC deployment (SuperLink, SuperNodes, ClientApp runtimes, ServerApp, the
``dpcfl`` supervisors) or of a simulation (driver, Ray workers, Ray's own daemons) used the
CPU, and how much of the machine sat idle. Linux only (reads /proc).
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dpcfl_flwr.runs.processes import TICKS, process_table
from dpcfl_flwr.runs.progress import ProgressTail

# First match on the command line wins; order matters (a supervisor's command line names the
# silo file, the SuperNode's names the launcher module).
ROLES: tuple[tuple[str, str], ...] = (
    ("warm_runtime", "ClientApp runtimes"),
    ("flwr-clientapp", "ClientApp runtimes"),
    ("supernode_launcher", "SuperNodes"),
    ("flower-supernode", "SuperNodes"),
    ("flwr-serverapp", "ServerApp"),
    ("superlink_launcher", "SuperLink"),
    ("flower-superlink", "SuperLink"),
    ("flwr run", "flwr CLI"),
    ("ray::", "Ray workers"),
    ("default_worker.py", "Ray workers"),
    ("raylet", "Ray daemons"),
    ("gcs_server", "Ray daemons"),
    ("ray/", "Ray daemons"),
    ("dpcfl", "dpcfl supervisors"),
)
DRIVER = "benchmark driver"
SAMPLER = "this sampling of /proc (in the driver)"
STOLEN = "stolen by the hypervisor"
OUTSIDE = "processes not started by the benchmark"


def _machine() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat: a shared
    VM's cores can be taken away, which looks like idle time to the processes."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / TICKS, steal / TICKS


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def role_of(command: str) -> str:
    for needle, role in ROLES:
        if needle in command:
            return role
    return "other"


@dataclass
class ProcessCpuSampler:
    """Samples the CPU time of this process and all its descendants every ``interval`` s, and
    notes when each round of a run ends (a new ``round`` line in ``progress``)."""

    progress: Path | None = None
    interval: float = 0.25
    times: list[float] = field(default_factory=list)
    samples: list[dict[int, float]] = field(default_factory=list)
    machine: list[tuple[float, float]] = field(default_factory=list)  # (busy, steal) seconds
    own: list[float] = field(default_factory=list)  # this sampler's own CPU seconds so far
    roles: dict[int, str] = field(default_factory=dict)
    round_ends: dict[int, tuple[float, float]] = field(default_factory=dict)  # round: (trained, s)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._tail = None if self.progress is None else ProgressTail(self.progress)

    def __enter__(self) -> ProcessCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        root = os.getpid()
        while not self._stop.is_set():
            self._sample(root)
            self._read_progress()
            self._stop.wait(self.interval)
        self._sample(root)

    def _sample(self, root: int) -> None:
        table = process_table()
        parents = {pid: parent for pid, (parent, _cpu) in table.items()}
        mine = {pid: cpu for pid, (_parent, cpu) in table.items()
                if _descends(pid, root, parents)}
        for pid in mine:  # read every time: a fresh fork shows its parent's command line
            command = _cmdline(pid)
            if pid == root:
                self.roles[pid] = DRIVER
            elif command or pid not in self.roles:
                self.roles[pid] = role_of(command)
        self.times.append(time.time())
        self.samples.append(mine)
        self.machine.append(_machine())
        self.own.append(time.thread_time())

    def _read_progress(self) -> None:
        if self._tail is None:
            return
        for event in self._tail.new_events():
            if event.get("event") == "round":
                # a round that evaluates reports once its evaluation is done too: its
                # training ended that long before
                trained = time.time() - float(event.get("evaluate_seconds") or 0.0)
                self.round_ends[event["round"]] = (trained, event["seconds"])

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds by role from the sample nearest ``start`` to the one nearest ``end``;
        processes born in between count from zero, ones that died count to their last
        sample. Also the machine's other busy time, the time its hypervisor took, and the
        sampling's own CPU, which is the driver's but not the measured run's work."""
        first_index, last_index = _nearest(self.times, start), _nearest(self.times, end)
        first = self.samples[first_index]
        latest: dict[int, float] = {}
        for sample in self.samples[first_index:last_index + 1]:
            latest.update(sample)
        totals: dict[str, float] = defaultdict(float)
        for pid, seconds in latest.items():
            totals[self.roles[pid]] += seconds - first.get(pid, 0.0)
        (busy0, steal0), (busy1, steal1) = self.machine[first_index], self.machine[last_index]
        totals[OUTSIDE] = max(0.0, busy1 - busy0 - sum(totals.values()))
        totals[STOLEN] = steal1 - steal0
        totals[SAMPLER] = self.own[last_index] - self.own[first_index]
        totals[DRIVER] -= totals[SAMPLER]
        return dict(totals)

    def round_window(self, number: int) -> tuple[float, float]:
        """(start, end) wall-clock times of a round's training (its evaluation left out), to
        this sampler's resolution."""
        end, seconds = self.round_ends[number]
        return end - seconds, end


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = parents.get(pid, 0)
    return False


def _nearest(times: list[float], moment: float) -> int:
    index = bisect_left(times, moment)
    if index == len(times):
        return index - 1
    if index > 0 and moment - times[index - 1] < times[index] - moment:
        return index - 1
    return index
