"""Scaling: round time and memory against the number of silos and their data size.

1. Simulation rounds of R-DPCFL with 21, 42 and 84 silos (topologies {3,6,6,6} x 1, 2, 4;
   N_i = 500; ``--silos``, ``--samples`` and ``--set key=value`` change them): wall time of a
   training round, the server's own work after it (the run's ``server_seconds``) and its
   share, and peak memory of the whole run (machine memory in use, sampled every 0.2 s, minus
   what was in use before).
2. The paper's N_i = 8000 (21 silos): the full-batch round 1 and one Poisson round.
3. Peak memory added by one full-batch DP round for N_i = 1,000, 8,000 and 32,000 (one
   process, gradient accumulation: it must stay flat).
4. The server's CPU per round-1 clustering and per aggregation rule on synthetic updates of
   21 to 1,000 silos, and Robust-HDP's cost against p' at 1,000.

  python bench/scaling.py [--parts silos,paper,full-batch,server] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish, simulate_quick  # noqa: E402
from dpcfl_flwr.aggregation.facts import RuleSettings, UpdateFacts  # noqa: E402
from dpcfl_flwr.aggregation.noise import aggregated_noise_level, oracle_noise_level  # noqa: E402
from dpcfl_flwr.aggregation.rules import combine  # noqa: E402
from dpcfl_flwr.clustering.gmm import UpdateClusterer  # noqa: E402
from dpcfl_flwr.clustering.noise_aware import NoiseAwareClusterer  # noqa: E402


def used_memory_mib() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(info["MemTotal"].split()[0])
    available = int(info["MemAvailable"].split()[0])
    return (total - available) / 1024


def process_rss_mib(marker: str) -> float:
    """Resident memory (MiB) of the processes whose command line holds ``marker`` (the run's
    own output directory names only its ``dpcfl simulate`` process), 0 if none runs."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


class PeakMemory(threading.Thread):
    """Peak machine memory in use above the start's, and peak RSS of the processes whose
    command line holds ``marker``, sampled every 0.2 s."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.baseline = used_memory_mib()
        self.peak = self.baseline
        self.process_peak = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, used_memory_mib())
            self.process_peak = max(self.process_peak, process_rss_mib(self.marker))

    def stop(self) -> tuple[float, float]:
        self.done.set()
        self.join()
        return self.peak - self.baseline, self.process_peak


def simulate(out: Path, **overrides: object) -> tuple[dict, float, float, float]:
    """One quick-example run with ``overrides``: results, wall seconds, peak memory of the run
    and of its server process (MiB)."""
    memory = PeakMemory(str(out))
    memory.start()
    wall, results = simulate_quick(out, **overrides)
    return (results, wall, *memory.stop())


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


# --- Part 4: the server's own work as the number of silos grows --------------------------------

#: The paper's CNN's parameter count (docs/algorithm.md): the length of one update.
CNN_PARAMETERS = 28_938
SERVER_SILOS = (21, 105, 210, 1_000)
#: The rules timed per cluster (min-eps and samples share one computation).
TIMED_RULES = ("samples", "weiavg", "oracle-variance", "pfa", "robust-hdp")


def synthetic_round(silos: int, seed: int = 0) -> tuple[np.ndarray, list[UpdateFacts], np.ndarray]:
    """(n, p) updates of ``silos`` silos in the topology {3,6,6,6} scaled up: four cluster
    means plus Gaussian noise whose per-coordinate std differs 4x from silo to silo (the
    spread of budgets the noise-aware study uses), the facts the server has of each, and the
    true cluster of each. Timing only: the clustering and rules' iteration counts depend on
    the structure, so it is the one the quick example has, not random noise."""
    rng = np.random.default_rng(seed)
    sizes = np.array([3, 6, 6, 6]) * silos / 21
    clusters = np.repeat(np.arange(4), np.diff(np.round(np.concatenate([[0], np.cumsum(sizes)])))
                         .astype(int))
    means = rng.normal(scale=0.01, size=(4, CNN_PARAMETERS))
    std = 0.01 * rng.uniform(0.5, 2.0, size=silos)
    updates = means[clusters] + rng.normal(size=(silos, CNN_PARAMETERS)) * std[:, None]
    epsilons = 5.0 / std * std.min()
    facts = [UpdateFacts(i, 500, float(epsilons[i]), float(std[i] ** 2)) for i in range(silos)]
    return updates, facts, clusters


def cpu_seconds(call: Callable[[], object]) -> float:
    """This process's CPU seconds for ``call`` on one BLAS thread: unlike wall time, not moved
    by other processes on a shared machine."""
    with threadpool_limits(1):
        start = time.process_time()
        call()
        return time.process_time() - start


def server_row(n: int) -> str:
    """One table row: the round-1 clusterings' and each rule's CPU seconds at ``n`` silos,
    and the noise-aware clustering's M and ARI against the true clusters."""
    from sklearn.metrics import adjusted_rand_score

    updates, facts, clusters = synthetic_round(n)
    reported = [f.noise_variance for f in facts]
    members = [np.flatnonzero(clusters == m) for m in range(4)]

    def rule_over_clusters(rule: str) -> list[object]:
        return [combine(rule, updates[idx], [facts[i] for i in idx]) for idx in members]

    spherical = cpu_seconds(lambda: UpdateClusterer(None, range(2, 11), random_state=0,
                                                    n_components=None).fit(updates))
    fitted: list[NoiseAwareClusterer] = []
    aware = cpu_seconds(lambda: fitted.append(NoiseAwareClusterer(
        None, range(2, 11), random_state=0, n_components=None).fit(updates, reported)))
    ari = adjusted_rand_score(clusters, fitted[0].labels_)
    rules = [cpu_seconds(lambda rule=rule: rule_over_clusters(rule)) for rule in TIMED_RULES]
    return (f"| {n:,} | {spherical:.2f} | {aware:.2f} | {fitted[0].n_clusters_}, "
            f"{ari:.2f} | " + " | ".join(f"{seconds:.2f}" for seconds in rules) + " |")


#: Robust-HDP's settings in the trade-off: the whole CNN update, two fixed p', and the
#: default, whose p' drops to ``rpca_auto_rows`` past ``rpca_work_limit``.
RPCA_SETTINGS = (
    ("28,938 (whole update)", RuleSettings(rpca_work_limit=None)),
    ("8,000", RuleSettings(rpca_rows=8_000, rpca_work_limit=None)),
    ("2,000", RuleSettings(rpca_rows=2_000, rpca_work_limit=None)),
    ("default: 1,000 past the work limit", RuleSettings()),
)


def rpca_rows_tradeoff(n: int) -> str:
    """Robust-HDP over the four clusters of ``n`` silos with RPCA on the first p' coordinates
    (``rpca-rows``, the paper's device for large models): CPU seconds against the DP noise
    of the weighted average relative to the oracle's inverse-variance weights (1 = optimal),
    and each silo's weight against the whole update's."""
    updates, facts, clusters = synthetic_round(n)
    rows, exact = [], None
    for label, settings in RPCA_SETTINGS:
        excess: list[float] = []
        weights: list[np.ndarray] = []

        def over_clusters(settings: RuleSettings = settings, excess: list = excess,
                          weights: list = weights) -> None:
            for m in range(4):
                idx = np.flatnonzero(clusters == m)
                truth = np.array([facts[i].noise_variance for i in idx])
                weights.append(combine("robust-hdp", updates[idx], [facts[i] for i in idx],
                                       settings).weights)
                excess.append(aggregated_noise_level(weights[-1], truth)
                              / oracle_noise_level(truth))

        seconds = cpu_seconds(over_clusters)
        together = np.concatenate(weights)
        exact = together if exact is None else exact
        moved = float(np.max(np.abs(together / exact - 1)))
        rows.append(f"| {label} | {seconds:.1f} | {max(excess):.4f} | {moved:.3f} |")
        print(rows[-1], flush=True)
    return (f"Robust-HDP at {n:,} silos against p' (`rpca-rows`): CPU seconds for the four "
            "clusters, the DP noise variance of each cluster's weighted average over the "
            "oracle's (inverse true variances), the worst of the four, and the largest "
            "relative change of a silo's weight against the whole update's:\n\n"
            "| p' | CPU s | noise over the oracle's | weight change |\n|---|---|---|---|\n"
            + "\n".join(rows))


def server_costs(silos: Sequence[int]) -> str:
    rows = []
    for n in silos:
        rows.append(server_row(n))
        print(rows[-1], flush=True)
    return ("The server's work in one round, CPU seconds on one BLAS thread (process time, so "
            f"not moved by a busy machine), on synthetic updates of the paper's CNN (p = "
            f"{CNN_PARAMETERS:,}): four clusters in the proportions {{3,6,6,6}}, noise std "
            "differing 4x between silos. Round 1: the clustering with M unknown (candidates "
            "2..10, M - 1 axes), and the noise-aware one's M and ARI against the true "
            "clusters; later rounds: each rule over the four clusters' members (robust-hdp "
            "with its default settings).\n\n"
            "| silos | round-1 clustering, spherical | noise-aware | noise-aware M, ARI | "
            + " | ".join(TIMED_RULES) + " |\n|---|---|---|---|" + "---|" * len(TIMED_RULES)
            + "\n" + "\n".join(rows) + "\n\n" + rpca_rows_tradeoff(max(silos)))


def silo_rounds(silos: Sequence[int], samples: int, tmp: Path,
                settings: Sequence[str] = ()) -> str:
    """The rounds of R-DPCFL simulations at each number of ``silos`` (N_i = ``samples``, run
    config ``settings`` "key=value" on top): each round's training exchange, the server's
    own work after it (round 1: the clustering; round 2: the aggregation) and its share of
    the round, memory and wall."""
    rows = []
    for n in silos:
        if n % 21:
            raise SystemExit(f"--silos takes multiples of 21 (topology {{3,6,6,6}} x k), got {n}")
        k = n // 21
        clusters = ",".join(str(size * k) for size in (3, 6, 6, 6))
        results, wall, peak, server = simulate(
            tmp / f"silos{n}", clusters=f'"{clusters}"', **{
                "samples-per-client": samples, "num-server-rounds": 3, "eval-every": 3,
                **dict(setting.split("=", 1) for setting in settings)})
        rounds = {r["round"]: r for r in results["rounds"]}
        rows.append(f"| {n:,} | {rounds[1]['seconds']:.1f} | {_server_share(rounds[1])} | "
                    f"{rounds[2]['seconds']:.1f} | {rounds[2]['seconds'] / n:.3f} | "
                    f"{_server_share(rounds[2])} | {peak:,.0f} | {server:,.0f} | {wall:.0f} |")
        print(rows[-1], flush=True)
    return (f"Simulation, R-DPCFL, N_i = {samples}, 3 rounds"
            + "".join(f", `{setting}`" for setting in settings) + ":\n\n"
            "| silos | round 1 (full batch) s | server's clustering s (share of round 1) | "
            "round 2 s | round 2 s per silo | server's aggregation s (share of round 2) | "
            "peak memory of the run (MiB) | peak RSS of the server process (MiB) | run wall "
            "(s) |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def _server_share(record: dict) -> str:
    """The server's work after a round's training exchange (results.json ``server_seconds``:
    checking the replies, then the method's clustering or aggregation), in seconds and as a
    share of the exchange and that work together."""
    server = record["server_seconds"]
    return f"{server:.2f} ({server / (record['seconds'] + server):.1%})"


def paper_scale(tmp: Path) -> str:
    results, wall, peak, _ = simulate(tmp / "paper", **{
        "samples-per-client": 8000, "num-server-rounds": 2, "eval-every": 2})
    rounds = {r["round"]: r for r in results["rounds"]}
    return (f"Paper scale, N_i = 8000, 21 silos: round 1 (full batch) "
            f"{rounds[1]['seconds']:.1f} s, round 2 (batch 32) "
            f"{rounds[2]['seconds']:.1f} s; peak memory of the run {peak:,.0f} MiB.")


def full_batch() -> str:
    rows = []
    for n in (1_000, 8_000, 32_000):
        m = full_batch_memory(n)
        rows.append(f"| {n:,} | {m['data_mib']:.0f} | {m['growth_mib']:.1f} | "
                    f"{m['seconds']:.1f} |")
    return ("One full-batch DP step (CNN, one process):\n\n| N_i | data held (MiB) | peak "
            "memory added by the round (MiB) | seconds |\n|---|---|---|---|\n"
            + "\n".join(rows))


PARTS = ("silos", "paper", "full-batch", "server")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default=",".join(PARTS), help=", ".join(PARTS))
    parser.add_argument("--silos", default="21,42,84", help="silos part: multiples of 21")
    parser.add_argument("--samples", type=int, default=500, help="silos part: N_i")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="silos part: a run config value on top of the quick example's "
                        "(repeatable), e.g. rdpcfl.clustering='\"noise-aware\"'")
    parser.add_argument("--server-silos", default=",".join(map(str, SERVER_SILOS)))
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.set and [part for part in parts if part != "server"] != ["silos"]:
        parser.error("--set applies to the silos part alone: run it with --parts silos")
    bad = [setting for setting in args.set if "=" not in setting]
    if bad:
        parser.error(f"--set takes KEY=VALUE, got {bad}")
    body = []
    silos = [int(n) for n in args.silos.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if "silos" in parts:
            body.append(silo_rounds(silos, args.samples, Path(tmp), args.set))
        if "paper" in parts:
            body.append(paper_scale(Path(tmp)))
    if "full-batch" in parts:
        body.append(full_batch())
    if "server" in parts:
        publish("Scaling: the server's work per round",
                server_costs([int(n) for n in args.server_silos.split(",")]),
                append=not args.no_append)
    if body:
        publish(_title(parts, silos, args.samples, args.set), "\n\n".join(body),
                append=not args.no_append)


def _title(parts: list[str], silos: list[int], samples: int, settings: Sequence[str] = ()
           ) -> str:
    """The section a run's rounds and memory go to: the silos part run alone has a section of
    its own for its range of silos, N_i and run config values (21 to 1,008 silos of 50
    records stands beside the default 21 to 84 of 500, with the paper scale and the
    full-batch step)."""
    if [part for part in parts if part != "server"] == ["silos"]:
        span = f"{silos[0]:,} silos" if len(silos) == 1 else (
            f"{silos[0]:,} to {silos[-1]:,} silos")
        return (f"Scaling: {span} (N_i = {samples}"
                + "".join(", " + setting.replace('"', "") for setting in settings) + ")")
    return "Scaling: silos, data size, memory"


if __name__ == "__main__":
    main()
