"""The first try on records nobody tuned for: does a run config holding only the schema, the
method and the budget (no learning rate, no M) get close to the best hand-tuned run?

Each federation is exported to files the way silos would hold them, in groups the server is
not told (the run config's ``clusters`` labels them for the evaluation only):

- ``fmnist-labelflip-raw``: Fashion-MNIST, 10 silos of 400 training records in groups
  {4, 3, 3} whose labels are permuted per group (the paper's label flip), as ``.npz`` arrays
  of raw 0..255 pixels (no normalisation: the default input scaling must cope);
- ``fmnist-iid-png`` (only when named: bench/m_choice_study.py covers i.i.d. silos):
  Fashion-MNIST, 10 silos of 400, no groups, as PNG image folders;
- ``digits-rotation-png`` (kept out of every choice of default, the final check): scikit-learn's
  8 x 8 handwritten digits (its wheel ships them), 9 silos of about 150 training records in
  groups {3, 3, 3} rotated by 0, 90 and 180 degrees, as PNG image folders, the MLP.

Per federation: R-DPCFL with the defaults (each silo chooses its learning rate privately, M
chosen against a null of no structure), R-DPCFL with M chosen and each hand-set learning rate
of the default candidates, ``local`` with the defaults, and the majority-class predictor (each
silo's most common training label, scored on its test split: a reference, not a private
method). Mean test accuracy over silos, M found, final ARI, the chosen learning rates and the
wall time.

  nice python bench/first_run.py [--federations ...] [--seed 0] [--epsilon 10] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402
from dpcfl_flwr.config.settings import STEP_LENGTHS  # noqa: E402
from dpcfl_flwr.data import Topology, load_dataset, make_client_data  # noqa: E402
from dpcfl_flwr.data.partition import normalisation  # noqa: E402

OUT = REPO / "results" / "first-run"
CLIP = 3.0  # the default clip norm: the hand-set rates are the default candidates
HAND_RATES = tuple(length / CLIP for length in STEP_LENGTHS)


def _fmnist_silos(groups: tuple[int, ...], shift: str, seed: int) -> list[Any]:
    train, test = load_dataset("fmnist", None)
    topology = Topology(groups)
    return [make_client_data(train, test, i, topology, shift, 400, seed=seed, test_samples=200)
            for i in range(topology.num_clients)]


def _raw_pixels(x: torch.Tensor) -> np.ndarray:
    """The benchmark's normalised images back to 0..255 pixels."""
    (mean,), (std,) = normalisation("fmnist")
    return np.clip(np.rint((x.numpy() * std + mean) * 255.0), 0, 255).astype(np.uint8)


def export_npz(root: Path, silos: list[Any]) -> None:
    for i, silo in enumerate(silos):
        np.savez(root / f"silo-{i}.npz", x_train=_raw_pixels(silo.x_train),
                 y_train=silo.y_train.numpy(), x_val=_raw_pixels(silo.x_val),
                 y_val=silo.y_val.numpy(), x_test=_raw_pixels(silo.x_test),
                 y_test=silo.y_test.numpy())


def export_png(root: Path, splits: list[dict[str, tuple[np.ndarray, np.ndarray]]]) -> None:
    """Per silo, ``silo-<i>/<split>/<label>/<k>.png`` from (uint8 images (n, H, W), labels)."""
    for i, silo in enumerate(splits):
        for split, (images, labels) in silo.items():
            for k, (image, label) in enumerate(zip(images, labels, strict=True)):
                folder = root / f"silo-{i}" / split / str(int(label))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image).save(folder / f"{k:05d}.png")


def digits_splits(groups: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    images = np.rint(x[order] * 255.0 / 16.0).astype(np.uint8).reshape(-1, 8, 8)
    labels = y[order]
    per = len(y) // sum(groups)
    out = []
    for i, group in enumerate(np.repeat(np.arange(len(groups)), groups)):
        rows = slice(i * per, (i + 1) * per)
        turned = np.rot90(images[rows], int(group), axes=(1, 2)).copy()
        cut = (int(0.6 * per), int(0.75 * per))
        out.append({"train": (turned[:cut[0]], labels[rows][:cut[0]]),
                    "val": (turned[cut[0]:cut[1]], labels[rows][cut[0]:cut[1]]),
                    "test": (turned[cut[1]:], labels[rows][cut[1]:])})
    return out


def build(name: str, root: Path, seed: int) -> dict[str, Any]:
    """Export one federation; returns its run-config keys (schema, source, paths, labels)
    and each silo's (train labels, test labels) for the majority baseline."""
    root.mkdir(parents=True, exist_ok=True)
    if name == "fmnist-labelflip-raw":
        silos = _fmnist_silos((4, 3, 3), "label_flip", seed)
        export_npz(root, silos)
        labels = [(s.y_train.numpy(), s.y_test.numpy()) for s in silos]
        keys = {"data-source": "arrays", "silo-data-paths": str(root / "silo-{partition}.npz"),
                "clusters": "4,3,3", "input-shape": "1,28,28", "model": "cnn"}
    elif name == "fmnist-iid-png":
        silos = _fmnist_silos((10,), "rotation", seed)
        export_png(root, [{split: (_raw_pixels(getattr(s, f"x_{split}"))[:, 0],
                                   getattr(s, f"y_{split}").numpy())
                           for split in ("train", "val", "test")} for s in silos])
        labels = [(s.y_train.numpy(), s.y_test.numpy()) for s in silos]
        keys = {"data-source": "image-folder", "silo-data-paths": str(root / "silo-{partition}"),
                "clusters": "10", "input-shape": "1,28,28", "model": "cnn"}
    elif name == "digits-rotation-png":
        splits = digits_splits((3, 3, 3), seed)
        export_png(root, splits)
        labels = [(s["train"][1], s["test"][1]) for s in splits]
        keys = {"data-source": "image-folder", "silo-data-paths": str(root / "silo-{partition}"),
                "clusters": "3,3,3", "input-shape": "1,8,8", "model": "mlp"}
    else:
        raise SystemExit(f"unknown federation {name!r}")
    return {"keys": keys, "labels": labels}


def majority_accuracy(labels: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Mean over silos of the test accuracy of predicting the silo's commonest train label."""
    scores = []
    for train, test in labels:
        top = Counter(train.tolist()).most_common(1)[0][0]
        scores.append(float(np.mean(test == top)))
    return 100.0 * float(np.mean(scores))


def simulate(keys: dict[str, Any], out: Path) -> dict[str, Any]:
    """One ``dpcfl simulate`` run (skipped if its results exist): results.json and wall."""
    results = out / "results.json"
    if not (results.exists() and json.loads(results.read_text()).get("complete")):
        command = [sys.executable, "-m", "dpcfl_flwr.cli", "simulate", "--out", str(out),
                   "--overwrite", "--quiet"]
        for key, value in keys.items():
            command += ["--set", f"{key}={value}"]
        started = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        (out / "wall.txt").write_text(f"{time.perf_counter() - started:.1f}")
    data = json.loads(results.read_text())
    data["wall"] = float((out / "wall.txt").read_text())
    return data


def _row(label: str, result: dict[str, Any]) -> str:
    accuracies = [c["test_accuracy"] for c in result["clients"] if c["test_accuracy"] is not None]
    rates = Counter(f"{c['learning_rate']:.3g}" for c in result["clients"]
                    if c.get("learning_rate"))
    clustering = result.get("clustering", {})
    m = clustering.get("n_clusters", "-")
    ari = clustering.get("final_ari", clustering.get("ari", "-"))
    ari_text = f"{ari:.2f}" if isinstance(ari, float) else str(ari)
    chosen = ", ".join(f"{r} x{n}" for r, n in sorted(rates.items())) or "set"
    if result.get("learning_rate"):
        chosen += f"; all train at {result['learning_rate']:.3g}"
    return (f"| {label} | {100 * float(np.mean(accuracies)):.1f} | {m} | {ari_text} | "
            f"{chosen} | {result['wall']:.0f} |")


def federation_table(name: str, seed: int, epsilon: float) -> str:
    root = OUT / f"{name}-seed{seed}"
    built = build(name, root / "data", seed)
    base = {**built["keys"], "method": "rdpcfl", "epsilon": epsilon, "seed": seed}
    lines = [f"**{name}** (seed {seed}, epsilon {epsilon:g}; majority class "
             f"{majority_accuracy(built['labels']):.1f}%)", "",
             "| run | mean acc (%) | M | final ARI | learning rates (silos' choices) | wall (s) |",
             "|---|---|---|---|---|---|"]
    lines.append(_row("R-DPCFL, defaults", simulate(base, root / "rdpcfl-defaults")))
    for rate in HAND_RATES:
        run = simulate({**base, "learning-rate": rate}, root / f"rdpcfl-lr{rate:.4g}")
        lines.append(_row(f"R-DPCFL, lr {rate:.3g} by hand", run))
    lines.append(_row("local, defaults", simulate({**base, "method": "local"},
                                                  root / "local-defaults")))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--federations",
                        default="fmnist-labelflip-raw,digits-rotation-png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    tables = [federation_table(name, args.seed, args.epsilon)
              for name in args.federations.split(",")]
    body = ("Run config: schema, data source, `method`, `epsilon` (and `clusters`, which "
            "labels the groups for the evaluation only); everything else default: 30 rounds, "
            "batch 32, clip 3, no learning rate, n-clusters 0. Hand-set rates are the default "
            "candidates. digits-rotation-png was kept out of every choice of default.\n\n"
            + "\n\n".join(tables))
    publish("The first try on records nobody tuned for", body, not args.no_append,
            bench="first_run")


if __name__ == "__main__":
    main()
