"""DLG over noise levels: one attack per (privatiser, noise), its table and its image grid.

Shared by ``dpcfl attack dlg`` (attacks/command.py) and ``bench/dlg.py``. Records are given
as pixels in [0, 1]; the model sees them normalised as in training (data/partition.py), and
every error is measured back in pixels, the reconstruction clipped to [0, 1] (an attacker
knows the pixel range).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..files import write_atomically
from .dlg import dlg_attack, paired, privatised_release, psnr, reconstruction_error

#: ``progress(privatiser, noise, iteration, distance)``
SweepProgress = Callable[[str, float, int, float], None]


@dataclass
class AttackRow:
    """One attack of a sweep: its setting, the error of its reconstruction (pixels in [0, 1])
    and the reconstruction itself (``pixels``, paired with the originals; not in the JSON)."""

    privatiser: str
    noise: float
    clip: float | None
    mse: float
    psnr: float
    labels: list[int]
    label_guess: list[int]
    gradient_distance: float
    iterations: int
    seconds: float
    pixels: torch.Tensor = field(repr=False)

    def to_json(self) -> dict[str, object]:
        row = asdict(self)
        del row["pixels"]
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in row.items()}


def run_sweep(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor,
              normalisation: tuple[Sequence[float], Sequence[float]], privatiser: str,
              noises: Sequence[float], *, clip: float, iterations: int, seed: int,
              num_classes: int, progress: SweepProgress | None = None) -> list[AttackRow]:
    """Attack the release of ``(pixels, labels)`` (one batch) under ``privatiser`` at each noise
    level. ``seed`` draws the noise (an evaluation, not a release: it should be repeatable)
    and the dummies; every level starts from the same dummies."""
    mean = torch.tensor(normalisation[0]).view(1, -1, 1, 1)
    std = torch.tensor(normalisation[1]).view(1, -1, 1, 1)
    inputs = (pixels - mean) / std
    rows = []
    for noise in noises:
        rng = np.random.default_rng([seed, 1])
        released = privatised_release(model, inputs, labels, privatiser, noise, clip, rng)
        report = None if progress is None else (
            lambda i, d, noise=noise: progress(privatiser, noise, i, d))
        result = dlg_attack(model, released, tuple(inputs.shape), num_classes, iterations,
                            seed, clip=clip if privatiser == "dpsgd" else None,
                            progress=report)
        guess = (result.reconstruction * std + mean).clamp(0.0, 1.0)
        rows.append(AttackRow(
            privatiser=privatiser, noise=float(noise),
            clip=clip if privatiser == "dpsgd" else None,
            mse=reconstruction_error(pixels, guess), psnr=psnr(pixels, guess),
            labels=[int(v) for v in labels], label_guess=result.label_guess,
            gradient_distance=result.final_distance, iterations=result.iterations,
            seconds=result.seconds, pixels=paired(pixels, guess)))
    return rows


def noise_symbol(privatiser: str) -> str:
    return {"dpsgd": "z", "dprivacy": "v"}.get(privatiser, "-")


def markdown_table(rows: Sequence[AttackRow], random_mse: float | None = None) -> str:
    """One line per attack: setting, MSE, PSNR, label guess; ``random_mse`` (the error of a
    random image) closes the table as the failure reference."""
    lines = ["| privatiser | noise | C | MSE (pixels) | PSNR (dB) | label guess / true | "
             "gradient distance |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        clip = "-" if row.clip is None else f"{row.clip:g}"
        noise = "-" if row.privatiser == "none" else f"{noise_symbol(row.privatiser)} = " \
                                                     f"{row.noise:g}"
        guesses = ", ".join(f"{g}/{t}" for g, t in zip(row.label_guess, row.labels, strict=True))
        lines.append(f"| {row.privatiser} | {noise} | {clip} | {row.mse:.4f} | "
                     f"{row.psnr:.1f} | {guesses} | {row.gradient_distance:.3g} |")
    if random_mse is not None:
        lines.append(f"\nA random image (uniform pixels) scores MSE {random_mse:.4f} against "
                     "the same records: an attack near it recovered nothing.")
    return "\n".join(lines)


def random_image_mse(pixels: torch.Tensor, seed: int) -> float:
    """The error of uniform random pixels against ``pixels``: the score of a failed attack."""
    noise = torch.rand(pixels.shape, generator=torch.Generator().manual_seed(seed))
    return reconstruction_error(pixels, noise)


def plot_grid(originals: torch.Tensor, columns: Sequence[tuple[str, torch.Tensor]],
              path: Path, title: str) -> Path:
    """A PNG grid: one row per record, the original first, then one reconstruction per
    ``(caption, pixels)`` column (pixels in [0, 1], shaped as ``originals``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    records, width = originals.shape[0], len(columns) + 1
    fig, axes = plt.subplots(records, width, figsize=(1.4 * width, 1.5 * records + 0.5),
                             squeeze=False)
    for r in range(records):
        panels = [("original", originals), *columns]
        for c, (caption, images) in enumerate(panels):
            image = images[r].permute(1, 2, 0).numpy()
            axes[r][c].imshow(image.squeeze(-1) if image.shape[-1] == 1 else image,
                              cmap="gray", vmin=0.0, vmax=1.0)
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
            if r == 0:
                axes[r][c].set_title(caption, fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(rows: Sequence[AttackRow], originals: torch.Tensor, out: Path,
                 setting: dict[str, object], title: str) -> list[Path]:
    """``dlg.json`` (setting and rows), ``dlg.md`` (the table) and ``dlg.png`` (the grid)."""
    out.mkdir(parents=True, exist_ok=True)
    random_mse = random_image_mse(originals, 0)
    payload = {"setting": setting, "random_image_mse": random_mse,
               "rows": [row.to_json() for row in rows]}
    json_path, md_path = out / "dlg.json", out / "dlg.md"
    table = f"# {title}\n\n{markdown_table(rows, random_mse)}\n"
    write_atomically(json_path, lambda f: f.write((json.dumps(payload, indent=2) + "\n").encode()),
                     durable=False)
    write_atomically(md_path, lambda f: f.write(table.encode()), durable=False)
    columns = [(f"{row.privatiser} {noise_symbol(row.privatiser)}={row.noise:g}\n"
                f"MSE {row.mse:.3f}", row.pixels) for row in rows]
    figure = plot_grid(originals, columns, out / "dlg.png", title)
    return [json_path, md_path, figure]
