"""Learning rate for a CPU-scale comparison, tuned the authors' way, and why it matters.

The authors tune the learning rate by DP-training clients on their own data. At a CPU scale a
client takes E * N_i / b steps (~470 at N_i = 1000, E = 15) instead of the paper's ~50,000, so
the paper's lr (0.005) leaves every method limited by its step count rather than by DP noise:
averaging silos, which only reduces noise, then gains nothing and the methods tie. This bench
trains the minority cluster's three silos (rotation 0) two ways at each lr, with the noise
multiplier a local client calibrates for the whole schedule:

- local: each silo alone (what the ``local`` baseline does);
- fedavg: the three silos averaged every round (what a correct cluster, or the oracle, does).

  python bench/cpu_scale_lr.py [--lrs 0.01,0.02,0.03,0.05] [--seeds 0,1] [--rounds 15]
                               [--samples 1000] [--epsilon 3] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.data import ClientData, Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig, configure_threads, evaluate, train_dp  # noqa: E402
from dpcfl_flwr.models import build_model  # noqa: E402
from dpcfl_flwr.privacy.calibration import calibrate_noise_multiplier
from dpcfl_flwr.privacy.schedule import single_stage_schedule  # noqa: E402

BATCH, CLIP, DELTA = 32, 3.0, 1e-4
MINORITY = (0, 1, 2)


def minority_silos(samples: int, seed: int) -> list[ClientData]:
    train, test = load_dataset("fmnist", None)
    topology = Topology.parse("3,6,6,6")
    return [make_client_data(train, test, i, topology, "rotation", samples, seed=seed)
            for i in MINORITY]


def fresh(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model("cnn")
    model.load_state_dict(weights)
    return model


def local_accuracy(silos: list[ClientData], init: dict, config: DPSGDConfig,
                   rounds: int) -> float:
    accuracies = []
    for silo in silos:
        model = fresh(init)
        for _ in range(rounds):
            train_dp(model, silo.x_train, silo.y_train, config)
        accuracies.append(evaluate(model, silo.x_test, silo.y_test)[1])
    return statistics.fmean(accuracies)


def fedavg_accuracy(silos: list[ClientData], init: dict, config: DPSGDConfig,
                    rounds: int) -> float:
    shared = {k: v.clone() for k, v in init.items()}
    for _ in range(rounds):
        updates = [train_dp(fresh(shared), s.x_train, s.y_train, config).update for s in silos]
        shared = {k: v + sum(u[k] for u in updates) / len(updates) for k, v in shared.items()}
    model = fresh(shared)
    return statistics.fmean(evaluate(model, s.x_test, s.y_test)[1] for s in silos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="0.005,0.01,0.02,0.03,0.05")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    configure_threads(1)
    lrs = [float(v) for v in args.lrs.split(",")]
    seeds = [int(v) for v in args.seeds.split(",")]
    z = calibrate_noise_multiplier(
        single_stage_schedule(args.samples, BATCH, 1, args.rounds), args.epsilon, DELTA)
    rows, started = [], time.perf_counter()
    for lr in lrs:
        config = DPSGDConfig(z, CLIP, lr, BATCH)
        local, fedavg = [], []
        for seed in seeds:
            silos = minority_silos(args.samples, seed)
            init = build_model("cnn", seed=seed).state_dict()
            local.append(100 * local_accuracy(silos, init, config, args.rounds))
            fedavg.append(100 * fedavg_accuracy(silos, init, config, args.rounds))
            print(f"lr {lr} seed {seed}: local {local[-1]:.1f}, fedavg {fedavg[-1]:.1f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        rows.append(f"| {lr} | {' / '.join(f'{a:.1f}' for a in local)} "
                    f"| {' / '.join(f'{a:.1f}' for a in fedavg)} "
                    f"| {statistics.fmean(fedavg) - statistics.fmean(local):+.1f} |")
    body = (f"Minority silos of FMNIST rotation, N_i = {args.samples}, E = {args.rounds}, "
            f"b = {BATCH}, c = {CLIP}, eps = {args.epsilon} (z = {z:.3f}), seeds "
            f"{', '.join(map(str, seeds))}; mean test accuracy (%) of the three silos.\n\n"
            "| lr | local (per seed) | FedAvg of the 3 (per seed) | FedAvg - local |\n"
            "|---|---|---|---|\n" + "\n".join(rows))
    publish("CPU-scale learning rate: local vs FedAvg of the minority silos", body,
            not args.no_append)


if __name__ == "__main__":
    main()
