"""Does R-DPCFL's unknown-M path find the number of groups, and one group where there is none?

Round 1 alone, as in bench/noise_aware_study.py: each silo's clean full-batch update (the
CNN, no noise) plus Gaussian noise of the variance its own plan gives it,
v_i = (z_i C / N_i)^2 at learning rate 1 (the clustering is blind to the update's scale).
Federations built from Fashion-MNIST (the paper's rotation and label-flip shifts, and i.i.d.
silos), and, kept out of every choice as the final check, scikit-learn's 8 x 8 handwritten
digits (a source the defaults were not chosen on; ``--scenarios digits-...``).

Per scenario, epsilon, mixture and rule: how often M equals the number of groups, the M
found, and the round-1 ARI. Rules: ``max-mss`` (the authors': the candidate of largest MSS)
and ``null`` (each candidate against a null of no structure, clustering/model_order.py).

  nice python bench/m_choice_study.py [--seeds 0,1,2] [--epsilons 10,3] [--scenarios ...]
      [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.clustering import NoiseAwareClusterer, UpdateClusterer  # noqa: E402
from dpcfl_flwr.clustering.model_order import fit_model_order  # noqa: E402
from dpcfl_flwr.data import Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.data.partition import ClientData  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig  # noqa: E402
from dpcfl_flwr.privacy.budget import plan_noise  # noqa: E402
from dpcfl_flwr.privacy.schedule import two_stage_schedule  # noqa: E402
from dpcfl_flwr.runs.round_one import round_one_updates  # noqa: E402

CLIP, DELTA, ROUNDS, BATCH, SELECT_ROUNDS, SELECT_RATIO = 3.0, 1e-4, 30, 32, 3, 0.03
MIXTURES = {"spherical": UpdateClusterer, "noise-aware": NoiseAwareClusterer}


@dataclass(frozen=True)
class Scenario:
    """A federation: groups of silos (sizes), the shift between groups, records per silo."""

    source: str
    groups: tuple[int, ...]
    shift: str
    samples: int

    @property
    def truth(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.groups)), self.groups)


SCENARIOS = {
    "rotation-21": Scenario("fmnist", (3, 6, 6, 6), "rotation", 500),
    "rotation-10": Scenario("fmnist", (4, 3, 3), "rotation", 400),
    "labelflip-10": Scenario("fmnist", (4, 3, 3), "label_flip", 400),
    "iid-10": Scenario("fmnist", (10,), "rotation", 400),
    "iid-21": Scenario("fmnist", (21,), "rotation", 500),
    "digits-rotation-9": Scenario("digits", (3, 3, 3), "rotation", 150),
    "digits-iid-9": Scenario("digits", (9,), "rotation", 150),
}


def digits_clients(scenario: Scenario, seed: int) -> list[ClientData]:
    """scikit-learn's handwritten digits (1,797 images of 8 x 8, in its wheel), enlarged to
    28 x 28 for the CNN, each silo ``samples`` of them drawn without overlap, group k rotated
    by k x 90 degrees."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    small = torch.tensor(x[order] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    images = torch.nn.functional.interpolate(small, size=(28, 28), mode="bilinear")
    labels = torch.tensor(y[order], dtype=torch.long)
    clients = []
    for i, group in enumerate(scenario.truth):
        rows = slice(i * scenario.samples, (i + 1) * scenario.samples)
        rotated = torch.rot90(images[rows], int(group), dims=(2, 3))
        clients.append(ClientData(i, int(group), rotated, labels[rows], rotated[:1],
                                  labels[rows][:1], rotated[:1], labels[rows][:1]))
    return clients


def clean_updates(scenario: Scenario, seed: int) -> np.ndarray:
    """Every silo's round-1 update without noise (z = 1e-9), learning rate 1."""
    if scenario.source == "digits":
        clients = digits_clients(scenario, seed)
    else:
        train, test = load_dataset(scenario.source, None)
        topology = Topology(scenario.groups)
        clients = [make_client_data(train, test, i, topology, scenario.shift,
                                    scenario.samples, seed=seed, test_samples=1)
                   for i in range(topology.num_clients)]
    config = DPSGDConfig(1e-9, CLIP, 1.0, "full")
    return round_one_updates(clients, "cnn", config, init_seed=seed, noise_seed=seed)


def round_one_variance(epsilon: float, num_train: int) -> float:
    """v = (z C / N)^2 of a silo's plan at learning rate 1 (the quick example's schedule)."""
    schedule = two_stage_schedule(num_train, BATCH, 1, ROUNDS, "full")
    z = plan_noise(schedule, epsilon, DELTA, SELECT_ROUNDS, SELECT_RATIO).noise_multiplier
    return float((z * CLIP / num_train) ** 2)


def fit(mixture: str, rule: str, noisy: np.ndarray, variances: np.ndarray,
        seed: int) -> UpdateClusterer:
    clusterer = MIXTURES[mixture](None, range(2, min(10, len(noisy) - 1) + 1),
                                  random_state=seed, n_components=None)
    if rule == "null":
        fit_model_order(clusterer, noisy, list(variances), seed=seed)
    else:
        clusterer.fit(noisy, list(variances))
    return clusterer


def study(names: Sequence[str], seeds: Sequence[int], epsilons: Sequence[float]) -> str:
    rows: dict[tuple[str, float, str, str], list[tuple[int, float, float]]] = {}
    started = time.perf_counter()
    for name in names:
        scenario = SCENARIOS[name]
        for seed in seeds:
            clean = clean_updates(scenario, seed)
            num_train = scenario.samples
            for epsilon in epsilons:
                v = np.full(len(clean), round_one_variance(epsilon, num_train))
                rng = np.random.default_rng([seed, int(epsilon * 1000)])
                noisy = (clean + rng.standard_normal(clean.shape) * np.sqrt(v)[:, None])
                for mixture in MIXTURES:
                    for rule in ("max-mss", "null"):
                        t = time.perf_counter()
                        fitted = fit(mixture, rule, noisy.astype(np.float32), v, seed)
                        ari = adjusted_rand_score(scenario.truth, fitted.labels_)
                        rows.setdefault((name, epsilon, mixture, rule), []).append(
                            (fitted.n_clusters_, ari, time.perf_counter() - t))
            print(f"{name} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return _table(rows, seeds, started)


def _table(rows: dict[tuple[str, float, str, str], list[tuple[int, float, float]]],
           seeds: Sequence[int], started: float) -> str:
    lines = ["| federation (groups) | epsilon | mixture | rule | M right | M found | "
             "round-1 ARI | fit (s) |", "|---|---|---|---|---|---|---|---|"]
    for (name, epsilon, mixture, rule), found in rows.items():
        groups = len(SCENARIOS[name].groups)
        ms = [m for m, _, _ in found]
        lines.append(
            f"| {name} ({groups}) | {epsilon:g} | {mixture} | {rule} | "
            f"{sum(m == groups for m in ms)}/{len(ms)} | {', '.join(map(str, ms))} | "
            f"{np.mean([a for _, a, _ in found]):.2f} | "
            f"{np.mean([t for _, _, t in found]):.1f} |")
    return (f"Round 1 alone, seeds {list(seeds)} (each its records, theta_init and noise); "
            "ARI 0 where one group is found in one group's silos is ARI's convention "
            "(both partitions trivial give 1 here).\n\n" + "\n".join(lines)
            + f"\n\n{time.perf_counter() - started:.0f} s in all.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epsilons", default="10,5,3")
    parser.add_argument("--scenarios", default="rotation-21,rotation-10,labelflip-10,iid-10,"
                        "iid-21")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    body = study(args.scenarios.split(","), [int(s) for s in args.seeds.split(",")],
                 [float(e) for e in args.epsilons.split(",")])
    publish("Choosing M: the number of groups, and one where there is none", body,
            not args.no_append, bench="m_choice_study")


if __name__ == "__main__":
    main()
