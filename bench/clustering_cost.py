"""Server clustering cost, and EM iterations against the round-1 batch size (Fig. 9 left).

1. Time and EM iterations of the server's clustering step (projection + spherical GMM) for
   p = 28,938 (CNN) and p = 11,181,642 (ResNet-18-GN) parameters, n = 21 and 210 silos, on
   synthetic round-1 updates with the paper's {3,6,6,6} structure (scaled to n); then both
   mixtures (spherical, noise-aware with v_i the larger of plan and estimate) on updates
   where every other silo carries 10x the noise std (100x the variance).
2. EM iterations on real Fashion-MNIST round-1 DP updates (N_i = 2000, eps = 10, E = 200) as
   the round-1 batch b1 grows from 32 to N_i: the paper reports fewer iterations for larger b1.

  python bench/clustering_cost.py [--no-append] [--cost-only] [--params 28938,11181642]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.clustering import NoiseAwareClusterer, UpdateClusterer  # noqa: E402
from dpcfl_flwr.data import Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig  # noqa: E402
from dpcfl_flwr.privacy.budget import plan_noise
from dpcfl_flwr.privacy.schedule import two_stage_schedule
from dpcfl_flwr.runs.round_one import round_one_updates  # noqa: E402


class SyntheticUpdates:
    """n round-1 updates in four clusters (3:6:6:6), made column block by column block on
    demand: 210 ResNet-18 updates would need 9.4 GB at once. Seeded per block."""

    def __init__(self, n: int, p: int, seed: int = 0, spread: float = 1.0) -> None:
        sizes = np.array([3, 6, 6, 6]) * n // 21
        sizes[-1] += n - sizes.sum()
        self.truth = np.repeat(np.arange(4), sizes)
        self.shape = (n, p)
        self.seed = seed
        # every other silo's noise std times ``spread``
        self.noise_std = np.where(np.arange(n) % 2 == 1, 2.0 * spread, 2.0).astype(np.float32)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows, cols = index
        start, stop, _ = cols.indices(self.shape[1])
        rng = np.random.default_rng([self.seed, start])
        centres = rng.standard_normal((4, stop - start), dtype=np.float32)
        noise = rng.standard_normal((self.shape[0], stop - start), dtype=np.float32)
        return (centres[self.truth] + self.noise_std[:, None] * noise)[rows]


def server_cost(n: int, p: int) -> tuple[float, int, float]:
    updates = SyntheticUpdates(n, p)
    start = time.perf_counter()
    fitted = UpdateClusterer(n_clusters=4, random_state=0).fit(updates)
    return time.perf_counter() - start, fitted.n_iter_, fitted.mss_


def mixture_cost(n: int, p: int, mixture: str) -> tuple[float, int, float, float]:
    """Seconds, EM iterations, MSS and ARI against the truth of one mixture on updates whose
    noise std is 2 for even silos and 20 for odd ones (v_i reported exactly)."""
    from sklearn.metrics import adjusted_rand_score

    updates = SyntheticUpdates(n, p, spread=10.0)
    start = time.perf_counter()
    if mixture == "noise-aware":
        fitted: UpdateClusterer = NoiseAwareClusterer(n_clusters=4, random_state=0).fit(
            updates, list(updates.noise_std.astype(float) ** 2))
    else:
        fitted = UpdateClusterer(n_clusters=4, random_state=0).fit(updates)
    seconds = time.perf_counter() - start
    return seconds, fitted.n_iter_, fitted.mss_, adjusted_rand_score(updates.truth,
                                                                      fitted.labels_)


def em_iterations_by_first_batch(batches: list[int | str], n_per_client: int,
                                 seeds: list[int]) -> dict[str, list[tuple[int, float]]]:
    train, test = load_dataset("fmnist", None)
    topology = Topology((3, 6, 6, 6))
    out: dict[str, list[tuple[int, float]]] = {}
    for seed in seeds:
        clients = [make_client_data(train, test, i, topology, "rotation", n_per_client,
                                    seed=seed, test_samples=1)
                   for i in range(topology.num_clients)]
        for b1 in batches:
            schedule = two_stage_schedule(n_per_client, 32, 1, 200, b1)
            # the paper's z: the authors' accounting (docs/privacy.md#reference-values)
            z = plan_noise(schedule, 10.0, 1e-4, select_rounds=20, conversion="classic",
                           mode="split", accountant="rdp").noise_multiplier
            updates = round_one_updates(clients, "cnn", DPSGDConfig(z, 3.0, 0.005, b1),
                                        init_seed=seed, noise_seed=1000 + seed)
            fitted = UpdateClusterer(n_clusters=4, random_state=seed).fit(updates)
            out.setdefault(str(b1), []).append((fitted.n_iter_, fitted.mss_))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--cost-only", action="store_true",
                        help="only the timings (no Fashion-MNIST training)")
    parser.add_argument("--params", default="28938,11181642")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(p) for p in args.params.split(",")]
    rows = []
    for p in sizes:
        for n in (21, 210):
            seconds, iterations, mss = server_cost(n, p)
            rows.append(f"| {p:,} | {n} | {seconds:.2f} | {iterations} | {mss:.2f} |")
    part1 = ("| parameters p | silos n | clustering time (s) | EM iterations | MSS |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows))
    rows = []
    for p in sizes:
        for n in (21, 210):
            for mixture in ("spherical", "noise-aware"):
                seconds, iterations, mss, ari = mixture_cost(n, p, mixture)
                rows.append(f"| {p:,} | {n} | {mixture} | {seconds:.2f} | {iterations} | "
                            f"{mss:.2f} | {ari:.2f} |")
    part1 += ("\n\nSame structure, odd silos with 10x the noise std (v_i reported exactly):"
              "\n\n| parameters p | silos n | mixture | clustering time (s) | EM iterations | "
              "MSS | ARI |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    if args.cost_only:
        publish("Server clustering cost: spherical and noise-aware mixtures", part1,
                append=not args.no_append)
        return
    n_i = 2000
    seeds = [int(s) for s in args.seeds.split(",")]
    by_batch = em_iterations_by_first_batch([32, 128, 512, "full"], n_i, seeds)
    rows = [f"| {b1 if b1 != 'full' else f'{n_i} (full)'} | "
            f"{np.mean([i for i, _ in v]):.1f} ({', '.join(str(i) for i, _ in v)}) | "
            f"{np.mean([m for _, m in v]):.2f} |" for b1, v in by_batch.items()]
    part2 = (f"Real Fashion-MNIST, 21 silos, N_i = {n_i}, eps = 10, E = 200, seeds {seeds}:\n\n"
             "| round-1 batch b1 | EM iterations: mean (per seed) | mean MSS |\n|---|---|---|\n"
             + "\n".join(rows))
    body = ("Synthetic round-1 updates, 4 clusters in proportion 3:6:6:6, one thread:\n\n"
            + part1 + "\n\n" + part2)
    publish("Server clustering cost and EM iterations vs round-1 batch", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
