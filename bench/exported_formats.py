"""The quick example on its own records exported to files: does the path a silo's records take
change anything a user sees?

Each of the quick example's 21 silos gets the very records the built-in reader gives it
(its resolved silo settings, :func:`dpcfl_flwr.silo.silo.client_records`), written as an image
folder of PNGs, a CSV table of 784 pixel columns with a split column, and a directory of .npy
files (bench/source_throughput.py's export). The quick example then runs with
``data-source`` and ``silo-data-paths`` naming each format, and the federation's schema as run
config keys, beside the built-in run, for each seed. Same N_i, same z and the same spend are
expected to the digit; accuracy within the seed-to-seed spread (DP noise is fresh every run).

  nice python bench/exported_formats.py [--seeds 0,1] [--no-append]
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
from bench.common import REPO, publish, script_module, simulate_quick  # noqa: E402
from dpcfl_flwr.config.config_file import load_config  # noqa: E402
from dpcfl_flwr.config.settings import SiloConfig  # noqa: E402
from dpcfl_flwr.silo.silo import client_records  # noqa: E402

MEAN, STD = 0.1307, 0.3081  # the benchmark's Fashion-MNIST normalisation
IMAGE_SCHEMA = {"input-shape": "1,28,28", "num-classes": 10, "image-mean": MEAN,
                "image-std": STD}


def export_silos(root: Path, seed: int) -> int:
    """Every silo's records of the quick example (seed ``seed``) under root/silo-<p>/ in every
    format; returns the number of silos."""
    export = script_module(REPO / "bench" / "source_throughput.py").export
    experiment = load_config(REPO / "examples" / "quick.toml", {"seed": seed})
    count = experiment.topology.num_clients
    for partition in range(count):
        settings = SiloConfig(partition_id=partition).resolved(experiment, True)
        export(client_records(settings, None), root / f"silo-{partition}")
    return count


def formats(root: Path) -> dict[str, dict[str, Any]]:
    """Per format, the run-config overrides that make every silo read its exported records."""
    silo = str(root / "silo-{partition}")
    features = ", ".join(f"p{i}:number" for i in range(784))
    return {
        "built-in reader": {},
        "image folder (PNG)": {"data-source": "image-folder",
                               "silo-data-paths": f"{silo}/images", **IMAGE_SCHEMA},
        "table (CSV)": {"data-source": "table", "silo-data-paths": f"{silo}/records.csv",
                        "split-column": "part", "input-shape": "1,28,28",
                        "num-classes": 10, "features": features},
        "arrays (.npy)": {"data-source": "arrays", "silo-data-paths": f"{silo}/npy",
                          **IMAGE_SCHEMA},
    }


def row(label: str, seed: int, wall: float, results: dict[str, Any],
        reference: dict[str, Any]) -> str:
    clients = {c["partition"]: c for c in results["clients"]}
    base = {c["partition"]: c for c in reference["clients"]}
    same_n = all(clients[p]["num_train"] == base[p]["num_train"] for p in base)
    same_z = all(clients[p]["noise_multiplier"] == base[p]["noise_multiplier"] for p in base)
    same_spend = all(clients[p]["epsilon_spent"] == base[p]["epsilon_spent"] for p in base)
    summary, clustering = results["summary"], results["clustering"]
    return (f"| {label} | {seed} | {_yes(same_n)} | {_yes(same_z)} | {_yes(same_spend)} | "
            f"{summary['max_epsilon_spent']:.3f} | {100 * summary['mean_accuracy']:.1f} | "
            f"{100 * summary['minority_accuracy']:.1f} | {clustering.get('ari', np.nan):.2f} | "
            f"{clustering.get('final_ari', np.nan):.2f} | {wall:.0f} s |")


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["| records | seed | same N_i | same z | same spend | largest spend | mean acc (%) "
             "| minority acc (%) | round-1 ARI | final ARI | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    accuracy: dict[str, list[float]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            export_silos(root / "records", seed)
            reference: dict[str, Any] | None = None
            for label, overrides in formats(root / "records").items():
                wall, results = simulate_quick(root / label.split()[0], seed=seed, **overrides)
                reference = reference or results
                lines.append(row(label, seed, wall, results, reference))
                accuracy.setdefault(label, []).append(100 * results["summary"]["mean_accuracy"])
                print(lines[-1], flush=True)
    means = "; ".join(f"{label} {np.mean(v):.1f}" for label, v in accuracy.items())
    body = ("The quick example (21 silos, eps 10, 30 rounds) with every silo's records "
            "exported to each format and read by its source; 'same' compares each silo with "
            "the built-in run of the same seed.\n\n" + "\n".join(lines)
            + f"\n\nMean accuracy over seeds (%): {means}.")
    publish("The quick example on records exported to files", body, append=not args.no_append)


if __name__ == "__main__":
    main()
