"""Does R-DPCFL's round-1 clustering survive budgets that differ from silo to silo?

Fashion-MNIST rotation {3, 6, 6, 6}, N_i = 1000 (examples/fmnist-cpu-1000.toml: E = 15,
lr = 0.03, b = 32, clip 3), 21 silos whose budgets follow one of four spreads, each scaled to
a median epsilon of 5 so that only the spread changes:

- ``equal``: every silo epsilon 5;
- ``dist2``: 5 x paper 002's Dist2 (1.0 .. 27, 27x between the extremes);
- ``dist8``: 25 x paper 002's Dist8 (4.3 .. 15.5, 3.6x; most silos at the bottom);
- ``x100``: 21 budgets spaced evenly in log from 0.5 to 50 (100x).

A *budget draw* says which silo gets which budget: draw 0 gives silo i the spread's value
i mod 20 (the paper's order); draw d > 0 a permutation of those values seeded by d.

Two parts:

1. ``round-one`` (minutes): round 1 alone, many seeds and draws. Round 1 is one full-batch
   DP-SGD step, so silo i's update is its clean (clipped, noise-free) update plus Gaussian
   noise of per-coordinate variance v_i = (lr z_i C / N_i)^2, z_i being the noise multiplier
   its own plan gives its budget (docs/algorithm.md#noise-aware-clustering). The clean updates
   are computed once per seed; each spread and draw adds its own noise. Reported per mixture:
   round-1 ARI over all silos and over the *separable* silos, and the silos placed with
   responsibility > 0.9 in a wrong cluster. A silo is *separable* when two things hold.
   (a) Its cluster can be seen at all: after whitening each update by its own noise, the
   cluster's direction stands out of the noise of n updates in p coordinates only above the
   spiked-model (BBP) threshold, sum over the cluster's silos j of ||mu_k - mu||^2 / v_j >
   sqrt(n p), mu_k being the cluster's clean mean and mu the mean of all clean updates.
   (b) Knowing the clean means, the Bayes rule would place it wrongly with probability below
   Phi(-2) = 2.3%: d_i / (2 sqrt(v_i + s_k^2)) >= 2, d_i being the distance from its cluster's
   clean mean to the nearest other cluster's, s_k^2 its cluster's clean per-coordinate spread.
2. ``round-one-share`` (seconds): could a silo with a small budget buy a cleaner round 1 by
   giving it a larger share of its budget? Per epsilon: what the full-batch round 1 spends on
   its own at today's z, and how much less round-1 noise (std) the silo gets if its later
   rounds take 1.5x, 2x or 4x today's z, or if round 1 took the whole training budget.
3. ``runs`` (hours, resumable): whole runs as ``dpcfl compare`` grids, 3 seeds, for today's
   spherical GMM, the noise-aware mixture, DP-FedAvg (``global``) and the oracle: round-1
   ARI, final ARI, exact partitions, mean and minority accuracy. Finished cells are kept:
   stop at any time and run the same command again to continue.

  nice python bench/noise_aware_study.py [--parts round-one,round-one-share,runs] [--seeds 0,1,2]
      [--spreads dist8,equal,dist2,x100] [--draws 0,1] [--variants noise-aware,spherical,...]
      [--table-only] [--no-append]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, compare_grid, finished_runs, publish  # noqa: E402
from dpcfl_flwr.clustering import NoiseAwareClusterer, UpdateClusterer  # noqa: E402
from dpcfl_flwr.config.paper_budgets import DISTRIBUTIONS  # noqa: E402
from dpcfl_flwr.data import Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig  # noqa: E402
from dpcfl_flwr.privacy.accountants import accountant_named  # noqa: E402
from dpcfl_flwr.privacy.budget import plan_noise  # noqa: E402
from dpcfl_flwr.privacy.defaults import AUTHORS_ACCOUNTING  # noqa: E402
from dpcfl_flwr.privacy.history import History  # noqa: E402
from dpcfl_flwr.privacy.schedule import two_stage_schedule  # noqa: E402
from dpcfl_flwr.runs.round_one import round_one_updates  # noqa: E402

CONFIG = REPO / "examples" / "fmnist-cpu-1000.toml"
OUT = REPO / "results" / "noise-aware-study"
TOPOLOGY = (3, 6, 6, 6)
SILOS = sum(TOPOLOGY)
MEDIAN_EPSILON = 5.0
SPREADS = ("dist8", "equal", "dist2", "x100")
# The run config's values (examples/fmnist-cpu-1000.toml), which the round-one part needs to
# plan each silo's z as the silo does: N_i = samples-per-client training records (validation
# records are drawn besides them); select-window 0.2 of 15 rounds = 3 private selections at
# 3% of epsilon each.
SAMPLES, ROUNDS, BATCH, LEARNING_RATE, CLIP, DELTA = 1000, 15, 32, 0.03, 3.0, 1e-4
SELECT_ROUNDS, SELECT_RATIO = 3, 0.03
CONFIDENT = 0.9
SEPARABLE_MARGIN = 2.0  # d / (2 sigma) >= 2: Bayes error below Phi(-2) = 2.3%
# Each mixture as the rdpcfl method's parameters select it.
# The study ran under the authors' accounting, the default then; named so that its published
# figures and finished cells keep their meaning (docs/privacy.md#the-default-accounting).
AUTHORS: dict[str, Any] = {"conversion": "classic", "mode": "split", "accountant": "rdp"}
MIXTURES = {"spherical": {"rdpcfl.clustering": "spherical"},
            "noise-aware": {"rdpcfl.clustering": "noise-aware"}}


def budgets(spread: str, draw: int) -> list[float]:
    """The 21 silos' epsilons of one spread and budget draw (module docstring)."""
    if spread == "equal":
        values = [MEDIAN_EPSILON] * SILOS
    elif spread == "x100":
        values = list(np.geomspace(MEDIAN_EPSILON / 10, MEDIAN_EPSILON * 10, SILOS))
    elif spread in ("dist2", "dist8"):
        preset = DISTRIBUTIONS[spread]
        scale = MEDIAN_EPSILON / float(np.median(preset))
        values = [preset[i % len(preset)] * scale for i in range(SILOS)]
    else:
        raise SystemExit(f"unknown spread {spread!r}; choose from {', '.join(SPREADS)}")
    if draw:
        values = list(np.random.default_rng(draw).permutation(values))
    return [round(float(v), 3) for v in values]


def noise_multiplier(epsilon: float, num_train: int) -> float:
    """z of a silo's plan: the two-stage schedule (round 1 full batch), 3 selections."""
    schedule = two_stage_schedule(num_train, BATCH, 1, ROUNDS, "full")
    return plan_noise(schedule, epsilon, DELTA, SELECT_ROUNDS, SELECT_RATIO,
                      **AUTHORS).noise_multiplier


def truth_labels() -> np.ndarray:
    return np.repeat(np.arange(len(TOPOLOGY)), TOPOLOGY)


def separable(clean: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """Per silo: does theory say round 1 can place it ((a) and (b) of the module docstring)?"""
    truth = truth_labels()
    clusters = range(len(TOPOLOGY))
    means = np.stack([clean[truth == k].mean(axis=0) for k in clusters])
    n, p = clean.shape
    signal = np.array([np.sum((means[k] - clean.mean(axis=0)) ** 2) for k in clusters])
    visible = np.array([np.sum(signal[k] / variances[truth == k]) > math.sqrt(n * p)
                        for k in clusters])
    spread = np.array([((clean[truth == k] - means[k]) ** 2).sum(axis=1).mean() / p
                       for k in clusters])
    distance = np.array([min(np.linalg.norm(means[k] - means[m]) for m in clusters if m != k)
                         for k in clusters])
    margin = distance[truth] / (2 * np.sqrt(variances + spread[truth]))
    return visible[truth] & (margin >= SEPARABLE_MARGIN)


def confidently_wrong(labels: np.ndarray, responsibilities: np.ndarray) -> int:
    """Silos whose largest responsibility exceeds CONFIDENT in a cluster that the best
    one-to-one matching of found to true clusters maps to another true cluster."""
    truth = truth_labels()
    found = responsibilities.shape[1]
    overlap = np.zeros((found, len(TOPOLOGY)))
    for f, t in zip(labels, truth, strict=True):
        overlap[f, t] += 1
    rows, cols = linear_sum_assignment(-overlap)
    mapped = dict(zip(rows, cols, strict=True))
    return int(sum(1 for i, f in enumerate(labels)
                   if responsibilities[i].max() > CONFIDENT and mapped.get(f, -1) != truth[i]))


def clean_updates(seed: int) -> tuple[np.ndarray, int]:
    """The 21 silos' round-1 updates without noise (z = 1e-9), and N_i (training records)."""
    train, test = load_dataset("fmnist", None)
    topology = Topology(TOPOLOGY)
    clients = [make_client_data(train, test, i, topology, "rotation", SAMPLES, seed=seed,
                                test_samples=1) for i in range(SILOS)]
    num_train = len(clients[0].y_train)
    config = DPSGDConfig(1e-9, CLIP, LEARNING_RATE, "full")
    return round_one_updates(clients, "cnn", config, init_seed=seed, noise_seed=seed), num_train


def fit(mixture: str, updates: np.ndarray, variances: np.ndarray, seed: int) -> UpdateClusterer:
    if mixture == "noise-aware":
        return NoiseAwareClusterer(4, random_state=seed, n_components=None).fit(
            updates, list(variances))
    return UpdateClusterer(4, random_state=seed, n_components=None).fit(updates)


def round_one(seeds: Sequence[int], spreads: Sequence[str], draws: Sequence[int],
              noise_draws: int) -> str:
    """Part 1 (module docstring): one row per spread and mixture over seeds x draws x noise."""
    truth = truth_labels()
    stats: dict[tuple[str, str], dict[str, list[float]]] = {}
    separable_count: dict[str, list[int]] = {}
    started = time.perf_counter()
    for seed in seeds:
        clean, num_train = clean_updates(seed)
        print(f"seed {seed}: clean updates ({time.perf_counter() - started:.0f} s)", flush=True)
        for spread in spreads:
            for draw in (draws if spread != "equal" else [0]):
                epsilons = budgets(spread, draw)
                z = np.array([noise_multiplier(e, num_train) for e in epsilons])
                variances = (LEARNING_RATE * z * CLIP / num_train) ** 2
                can = separable(clean, variances)
                separable_count.setdefault(spread, []).append(int(can.sum()))
                for trial in range(noise_draws):
                    rng = np.random.default_rng([seed, draw, trial])
                    noisy = clean + rng.standard_normal(clean.shape) * np.sqrt(variances)[:, None]
                    for mixture in MIXTURES:
                        fitted = fit(mixture, noisy.astype(np.float32), variances, seed)
                        labels = np.asarray(fitted.labels_)
                        row = stats.setdefault((spread, mixture), {})
                        row.setdefault("ari", []).append(adjusted_rand_score(truth, labels))
                        row.setdefault("ari_separable", []).append(
                            adjusted_rand_score(truth[can], labels[can]) if can.sum() >= 2
                            else math.nan)
                        row.setdefault("wrong", []).append(confidently_wrong(
                            labels, np.asarray(fitted.responsibilities_)))
                        row.setdefault("exact", []).append(
                            float(adjusted_rand_score(truth, labels) == 1.0))
    lines = ["| spread (epsilons) | mixture | round-1 ARI | ARI, separable silos | "
             "separable silos | exact | silos confidently wrong (total) |",
             "|---|---|---|---|---|---|---|"]
    for spread in spreads:
        values = budgets(spread, 0)
        for mixture in MIXTURES:
            row = stats[(spread, mixture)]
            lines.append(
                f"| {spread} ({min(values):g}..{max(values):g}) | {mixture} | "
                f"{_mean_sd(row['ari'])} | {_mean_sd(row['ari_separable'])} | "
                f"{np.mean(separable_count[spread]):.1f} of {SILOS} | "
                f"{int(sum(row['exact']))}/{len(row['exact'])} | {int(sum(row['wrong']))} |")
    trials = len(seeds) * noise_draws
    return (f"Round 1 alone: the clean full-batch updates of seeds {list(seeds)} plus the DP "
            f"noise of each silo's plan, draws {list(draws)} of each spread, {noise_draws} "
            f"noise draws each ({trials} trials per draw); M = 4, the projection on M - 1 "
            f"axes, noise-aware with v_i the larger of plan and estimate.\n\n"
            + "\n".join(lines)
            + f"\n\n{time.perf_counter() - started:.0f} s in all.")


def round_one_share(epsilons: Sequence[float] = (0.5, 1, 2, 5, 15)) -> str:
    """Part 2 (module docstring), under the authors' accounting (RDP, their split of the
    budget between training and selections), which the study's runs use."""
    accountant = accountant_named("rdp")
    num_train = SAMPLES
    phases = two_stage_schedule(num_train, BATCH, 1, ROUNDS, "full")
    later = phases[1]
    lines = ["| epsilon | z today | round 1 alone spends (of eps_train) | round-1 noise std "
             "less by, later rounds at 1.5x / 2x / 4x z | round 1 with the whole budget |",
             "|---|---|---|---|---|"]
    for epsilon in epsilons:
        plan = plan_noise(phases, epsilon, DELTA, SELECT_ROUNDS, SELECT_RATIO, **AUTHORS)
        z, train = plan.noise_multiplier, plan.split.epsilon_train
        alone = accountant.epsilon(History(gaussian=((z, 1.0, 1),)), DELTA)
        floor = plan_noise(phases[:1], epsilon, DELTA, SELECT_ROUNDS,
                           SELECT_RATIO, **AUTHORS).noise_multiplier
        gains = []
        for factor in (1.5, 2.0, 4.0):
            low, high = floor, z  # bisection: the least z1 that still fits eps_train
            for _ in range(40):
                middle = (low + high) / 2
                spent = accountant.epsilon(History(gaussian=(
                    (middle, 1.0, 1), (factor * z, later.sample_rate, later.steps))), DELTA)
                low, high = (low, middle) if spent <= train else (middle, high)
            gains.append(f"{z / high:.2f}x")
        lines.append(f"| {epsilon:g} | {z:.2f} | {alone:.2f} of {train:.2f} "
                     f"({alone / train:.0%}) | {' / '.join(gains)} | {z / floor:.2f}x |")
    return (f"N_i = {num_train} training records, E = {ROUNDS}, b = {BATCH}, "
            f"{SELECT_ROUNDS} selections at {SELECT_RATIO:.0%} of epsilon, delta {DELTA:g}; "
            "RDP accountant, split budget mode.\n\n" + "\n".join(lines))


def _mean_sd(values: Sequence[float], digits: int = 2) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "n/a"
    return f"{np.mean(finite):.{digits}f} ± {np.std(finite):.{digits}f}"


def grid_out(spread: str, draw: int) -> Path:
    return OUT / "runs" / f"{spread}-draw{draw}"


VARIANTS = ("noise-aware", "spherical", "global", "oracle")


def run_grids(seeds: str, spreads: Sequence[str], draws: Sequence[int],
              chosen: Sequence[str] = VARIANTS) -> None:
    """Part 3's grids, one variant at a time over every spread and draw, so that an early
    stop has the question's answer first: the noise-aware mixture, today's, DP-FedAvg, the
    oracle. Each cell is resumable."""
    variants = {mixture: ("rdpcfl", mixture, MIXTURES[mixture]) for mixture in MIXTURES}
    variants |= {method: (method, "baselines", {}) for method in ("global", "oracle")}
    for method, folder, overrides in (variants[name] for name in VARIANTS if name in chosen):
        for spread in spreads:
            for draw in (draws if spread != "equal" else [0]):
                epsilons = ",".join(f"{e:g}" for e in budgets(spread, draw))
                compare_grid(CONFIG, method, seeds, grid_out(spread, draw) / folder,
                             {"silo-epsilons": epsilons, **AUTHORS_ACCOUNTING, **overrides},
                             epsilons="5")


def runs_table(spreads: Sequence[str], draws: Sequence[int]) -> str:
    lines = ["| spread | method | runs | round-1 ARI | confidently wrong in round 1 | "
             "final ARI | exact partition | mean acc (%) | minority acc (%) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spread in spreads:
        rows: dict[str, list[dict[str, Any]]] = {}
        for draw in (draws if spread != "equal" else [0]):
            out = grid_out(spread, draw)
            for mixture in MIXTURES:
                rows.setdefault(f"rdpcfl, {mixture}", []).extend(finished_runs(out / mixture))
            for results in finished_runs(out / "baselines"):
                rows.setdefault(results["method"], []).append(results)
        for name, found in rows.items():
            if not found:
                continue
            clustering = [r["clustering"] for r in found]
            summary = [r["summary"] for r in found]
            r1 = [c["ari"] for c in clustering if "ari" in c]
            final = [c["final_ari"] for c in clustering if "final_ari" in c]
            wrong = [confidently_wrong(np.asarray(c["labels"]), np.asarray(c["responsibilities"]))
                     for c in clustering if "labels" in c]
            lines.append(
                f"| {spread} | {name} | {len(found)} | {_mean_sd(r1) if r1 else '-'} | "
                f"{sum(wrong) if wrong else '-'} | {_mean_sd(final) if final else '-'} | "
                f"{sum(1 for f in final if f == 1.0) if final else '-'}"
                f"{'/' + str(len(final)) if final else ''} | "
                f"{_mean_sd([100 * s['mean_accuracy'] for s in summary], 1)} | "
                f"{_mean_sd([100 * s['minority_accuracy'] for s in summary], 1)} |")
    return ("Whole runs (`dpcfl compare`, examples/fmnist-cpu-1000.toml, silo-epsilons of the "
            f"spread and draw; draws {list(draws)}), mean ± sd over the finished runs:\n\n"
            + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="round-one,round-one-share,runs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--spreads", default=",".join(SPREADS))
    parser.add_argument("--draws", default="0,1")
    parser.add_argument("--noise-draws", type=int, default=4,
                        help="round-one: noise draws per seed and budget draw")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="runs: which of " + ", ".join(VARIANTS))
    parser.add_argument("--table-only", action="store_true",
                        help="runs: tabulate the finished cells, run nothing")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    spreads = args.spreads.split(",")
    draws = [int(d) for d in args.draws.split(",")]
    for spread in spreads:
        budgets(spread, 0)  # an unknown spread stops here, before any work
    if "round-one" in parts:
        publish("Noise-aware clustering: round 1 under budget spreads",
                round_one(seeds, spreads, draws, args.noise_draws), append=not args.no_append)
    if "round-one-share" in parts:
        publish("Noise-aware clustering: a larger round-1 share of a small budget",
                round_one_share(), append=not args.no_append)
    if "runs" in parts:
        if not args.table_only:
            run_grids(args.seeds, spreads, draws, args.variants.split(","))
        publish("Noise-aware clustering: whole runs under budget spreads",
                runs_table(spreads, draws), append=not args.no_append)


if __name__ == "__main__":
    main()
