"""Scaling: round time and memory against the number of silos and their data size.

1. Simulation rounds of R-DPCFL with 21, 42 and 84 silos (topologies {3,6,6,6} x 1, 2, 4;
   N_i = 500): wall time of a training round and peak memory of the whole run (machine memory
   in use, sampled every 0.2 s, minus what was in use before).
2. The paper's N_i = 8000 (21 silos): the full-batch round 1 and one Poisson round.
3. Peak memory added by one full-batch DP round for N_i = 1,000, 8,000 and 32,000 (one
   process, gradient accumulation: it must stay flat).

  python bench/scaling.py [--no-append]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish, simulate_quick  # noqa: E402


def used_memory_mib() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(info["MemTotal"].split()[0])
    available = int(info["MemAvailable"].split()[0])
    return (total - available) / 1024


class PeakMemory(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.baseline = used_memory_mib()
        self.peak = self.baseline
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, used_memory_mib())

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak - self.baseline


def simulate(out: Path, **overrides: object) -> tuple[dict, float, float]:
    memory = PeakMemory()
    memory.start()
    wall, results = simulate_quick(out, **overrides)
    return results, wall, memory.stop()


_FULL_BATCH = """
import json, resource, sys, torch
from dpcfl_flwr.models import build_model
from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp
torch.set_num_threads(1)
n = int(sys.argv[1])
x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
model = build_model("cnn", seed=0)
config = DPSGDConfig(1.0, 3.0, 0.005, "full")
train_dp(model, x[:64], y[:64], config, seed=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = __import__("time").perf_counter()
train_dp(model, x, y, config, seed=0)
seconds = __import__("time").perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mib": (after - before) / 1024, "data_mib": x.numel() * 4 / 2**20,
                  "seconds": seconds}))
"""


def full_batch_memory(n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _FULL_BATCH, str(n)], check=True,
                         capture_output=True, text=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for scale, clusters in ((1, "3,6,6,6"), (2, "6,12,12,12"), (4, "12,24,24,24")):
            results, wall, peak = simulate(Path(tmp) / f"x{scale}", clusters=f'"{clusters}"',
                                           **{"num-server-rounds": 3, "eval-every": 3})
            rounds = {r["round"]: r for r in results["rounds"]}
            n = 21 * scale
            rows.append(f"| {n} | {rounds[1]['seconds']:.1f} | {rounds[2]['seconds']:.1f} | "
                        f"{rounds[2]['seconds'] / n:.3f} | {peak:,.0f} | {wall:.0f} |")
        parts.append("| silos | round 1 (full batch) s | round 2 s | round 2 s per silo | "
                     "peak memory of the run (MiB) | run wall (s) |\n|---|---|---|---|---|---|\n"
                     + "\n".join(rows))
        results, wall, peak = simulate(Path(tmp) / "paper", **{
            "samples-per-client": 8000, "num-server-rounds": 2, "eval-every": 2})
        rounds = {r["round"]: r for r in results["rounds"]}
        parts.append(f"Paper scale, N_i = 8000, 21 silos: round 1 (full batch) "
                     f"{rounds[1]['seconds']:.1f} s, round 2 (batch 32) "
                     f"{rounds[2]['seconds']:.1f} s; peak memory of the run {peak:,.0f} MiB.")
    rows = []
    for n in (1_000, 8_000, 32_000):
        m = full_batch_memory(n)
        rows.append(f"| {n:,} | {m['data_mib']:.0f} | {m['growth_mib']:.1f} | "
                    f"{m['seconds']:.1f} |")
    parts.append("One full-batch DP step (CNN, one process):\n\n| N_i | data held (MiB) | peak "
                 "memory added by the round (MiB) | seconds |\n|---|---|---|---|\n"
                 + "\n".join(rows))
    body = "\n\n".join(parts)
    publish("Scaling: silos, data size, memory", body, append=not args.no_append)


if __name__ == "__main__":
    main()
