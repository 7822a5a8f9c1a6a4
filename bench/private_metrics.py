"""What private evaluation metrics cost on the quick example: epsilon, noise, and the error of
the figures a silo reports.

For each seed, the quick example runs twice in one session: with exact metrics (the simulation
default) and with ``metrics = "private"`` (a deployed silo's default: no validation figures,
test figures through the Gaussian mechanism with noise multiplier ``metrics-noise``, charged and
reserved for the run's evaluations; docs/threat-model.md). For the private run the final cluster
models are also evaluated exactly on every silo's test split, so the reported (noised) figures
can be set against the true ones.

  python bench/private_metrics.py [--seeds 0,1,2] [--metrics-noise 10] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish, simulate_quick  # noqa: E402
from dpcfl_flwr.config.settings import parse_node_config, parse_run_config  # noqa: E402
from dpcfl_flwr.dpsgd.training import evaluate  # noqa: E402
from dpcfl_flwr.silo.silo import Silo  # noqa: E402


def true_accuracies(out: Path, results: dict[str, Any]) -> dict[int, float]:
    """Each silo's exact test accuracy on the model of its final cluster."""
    experiment = parse_run_config(results["config"])
    models = {m: torch.load(out / "models" / f"cluster-{m}.pt")
              for m in {c["final_cluster"] for c in results["clients"]}}
    accuracy = {}
    for client in results["clients"]:
        silo = Silo(parse_node_config({"partition-id": client["partition"]}), experiment, 0,
                    trust_run_config=True)
        model = silo.new_model(models[client["final_cluster"]])
        accuracy[client["partition"]] = evaluate(model, silo.data.x_test, silo.data.y_test)[1]
    return accuracy


def _row(seed: int, mode: str, results: dict[str, Any],
         truth: dict[int, float] | None) -> tuple[str, dict[str, float]]:
    clients = results["clients"]
    reported = {c["partition"]: c["test_accuracy"] for c in clients}
    figures = {"z": float(np.mean([c["noise_multiplier"] for c in clients])),
               "eps": max(c["epsilon_spent"] for c in clients),
               "reported": float(np.mean(list(reported.values())))}
    error = "-"
    if truth is not None:
        figures["true"] = float(np.mean(list(truth.values())))
        gaps = np.array([reported[p] - truth[p] for p in truth])
        figures["silo_error"] = float(np.sqrt(np.mean(gaps**2)))
        figures["mean_error"] = abs(figures["reported"] - figures["true"])
        error = (f"{100 * figures['silo_error']:.2f} pp rms per silo, "
                 f"{100 * figures['mean_error']:.2f} pp on the mean")
    else:
        figures["true"] = figures["reported"]
    return (f"| {seed} | {mode} | {figures['z']:.4f} | {figures['eps']:.3f} | "
            f"{100 * figures['reported']:.2f}% | {100 * figures['true']:.2f}% | {error} |",
            figures)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--metrics-noise", type=float, default=10.0)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    rows, exact, private = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            _, results = simulate_quick(Path(tmp) / f"exact-{seed}", seed=seed,
                                        metrics='"exact"')
            row, figures = _row(seed, "exact", results, None)
            rows.append(row)
            exact.append(figures)
            out = Path(tmp) / f"private-{seed}"
            _, results = simulate_quick(out, seed=seed, metrics='"private"',
                                        **{"metrics-noise": args.metrics_noise})
            row, figures = _row(seed, "private", results, true_accuracies(out, results))
            rows.append(row)
            private.append(figures)
            print(rows[-2], rows[-1], sep="\n", flush=True)

    def mean(runs: list[dict[str, float]], key: str) -> float:
        return float(np.mean([r[key] for r in runs]))

    body = (
        f"Quick example (eps = 10, delta = 1e-4, 30 rounds, 6 evaluations), exact metrics "
        f"against private ones at metrics-noise = {args.metrics_noise:g}. z: the silos' mean "
        "noise multiplier; eps: the largest spend; reported: the mean test accuracy the server "
        "received; true: the same models evaluated exactly on every silo's test split.\n\n"
        "| seed | metrics | z | eps spent | reported acc | true acc | error of the reported |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) +
        f"\n\nMeans over {len(exact)} seeds: z {mean(exact, 'z'):.4f} (exact) -> "
        f"{mean(private, 'z'):.4f} (private), x{mean(private, 'z') / mean(exact, 'z'):.4f}; "
        f"true accuracy {100 * mean(exact, 'true'):.2f}% -> {100 * mean(private, 'true'):.2f}%; "
        f"the reported figures are off by {100 * mean(private, 'silo_error'):.2f} pp per silo "
        f"(rms) and {100 * mean(private, 'mean_error'):.2f} pp on the mean; eps spent "
        f"{mean(exact, 'eps'):.3f} -> {mean(private, 'eps'):.3f} (the evaluations are in it).")
    publish("Private metrics: their cost on the quick example", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
