"""DLG against both privatisers (paper 004 Fig. 5): reconstruction error as noise grows.

A few Fashion-MNIST training records, each attacked alone (batch of one) on a fresh CNN, once
with the repository's ReLU CNN and once with its sigmoid variant (the DLG paper's choice,
docs/attacks.md#dlg-in-short), under:

- d-privacy (paper 004's SanitizeUpdate), v in {0, 0.001, 0.01, 0.1, 1, 10};
- DP-SGD (clip to C = 1, Gaussian noise z C), z in {0, 0.01, 0.1, 1}; the attacker clips its
  dummy's gradient to the same C.

Mean MSE (pixels in [0, 1]) per setting, beside the MSE of a random image, and the image grid
bench/figures/dlg.png. A few minutes on one core.

  python bench/dlg.py [--records 0,1,2] [--iterations 30] [--no-append]
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
from dpcfl_flwr.attacks.dlg import attack_model  # noqa: E402
from dpcfl_flwr.attacks.sweep import AttackRow, plot_grid, random_image_mse, run_sweep  # noqa: E402
from dpcfl_flwr.data import load_dataset, normalisation  # noqa: E402

FIGURE = Path(__file__).with_name("figures") / "dlg.png"
SETTINGS = {"dprivacy": [0.0, 0.001, 0.01, 0.1, 1.0, 10.0], "dpsgd": [0.0, 0.01, 0.1, 1.0]}
CLIP = 1.0
ACTIVATIONS = ("relu", "sigmoid")


def attack_all(records: list[int], iterations: int) -> dict[str, list[list[AttackRow]]]:
    """Per activation, per record, the rows of every (privatiser, noise) setting in order."""
    train, _ = load_dataset("fmnist", None)
    out: dict[str, list[list[AttackRow]]] = {a: [] for a in ACTIVATIONS}
    for activation in ACTIVATIONS:
        for seed, index in enumerate(records):
            start = time.perf_counter()
            pixels = torch.from_numpy(train.images[[index]]).float() / 255.0
            labels = torch.from_numpy(train.labels[[index]])
            model = attack_model("cnn", 10, 1, activation, seed)
            rows = []
            for privatiser, noises in SETTINGS.items():
                rows += run_sweep(model, pixels, labels, normalisation("fmnist"), privatiser,
                                  noises, clip=CLIP, iterations=iterations, seed=seed,
                                  num_classes=10)
            out[activation].append(rows)
            print(f"{activation} record {index}: {time.perf_counter() - start:.0f} s",
                  flush=True)
    return out


def table(results: dict[str, list[list[AttackRow]]], random_mse: float) -> str:
    lines = ["| privatiser | noise | mean MSE, ReLU CNN (per record) | mean MSE, sigmoid CNN "
             "(per record) | labels right (ReLU / sigmoid) |", "|---|---|---|---|---|"]
    first = results[ACTIVATIONS[0]][0]
    for k, setting in enumerate(first):
        cells, right = [], []
        for activation in ACTIVATIONS:
            mses = [rows[k].mse for rows in results[activation]]
            cells.append(f"{np.mean(mses):.4f} ({', '.join(f'{m:.3f}' for m in mses)})")
            right.append(str(sum(rows[k].label_guess == rows[k].labels
                                 for rows in results[activation])))
        symbol = "v" if setting.privatiser == "dprivacy" else "z"
        lines.append(f"| {setting.privatiser} | {symbol} = {setting.noise:g} | {cells[0]} | "
                     f"{cells[1]} | {' / '.join(right)} of {len(results[ACTIVATIONS[0]])} |")
    lines.append(f"| random image | - | {random_mse:.4f} | {random_mse:.4f} | - |")
    return "\n".join(lines)


def figure(results: dict[str, list[list[AttackRow]]], originals: torch.Tensor) -> Path:
    first = results[ACTIVATIONS[0]][0]
    columns = []
    for k, setting in enumerate(first):
        symbol = "v" if setting.privatiser == "dprivacy" else "z"
        images = torch.cat([rows[k].pixels for a in ACTIVATIONS for rows in results[a]])
        columns.append((f"{setting.privatiser}\n{symbol}={setting.noise:g}", images))
    both = torch.cat([originals] * len(ACTIVATIONS))
    rows = len(originals)
    return plot_grid(both, columns, FIGURE,
                     f"DLG on Fashion-MNIST: rows 1-{rows} ReLU CNN, rows {rows + 1}-"
                     f"{2 * rows} sigmoid CNN")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", default="0,1,2")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = [int(r) for r in args.records.split(",")]
    start = time.perf_counter()
    results = attack_all(records, args.iterations)
    train, _ = load_dataset("fmnist", None)
    originals = torch.from_numpy(train.images[records]).float() / 255.0
    random_mse = float(np.mean([random_image_mse(originals[i:i + 1], 0)
                                for i in range(len(records))]))
    path = figure(results, originals)
    body = (f"Fashion-MNIST training records {records} (labels "
            f"{[int(v) for v in train.labels[records]]}), each attacked alone on a fresh CNN "
            f"(seed = its position), DLG with {args.iterations} L-BFGS steps; MSE in pixels "
            f"of [0, 1]; DP-SGD with C = {CLIP:g}, the attacker clipping its dummy's gradient "
            f"to C. {time.perf_counter() - start:.0f} s on one thread.\n\n"
            + table(results, random_mse)
            + f"\n\n![DLG reconstructions](figures/{path.name})")
    publish("DLG reconstruction error against d-privacy and DP-SGD noise", body,
            append=not args.no_append, bench="dlg")


if __name__ == "__main__":
    main()
