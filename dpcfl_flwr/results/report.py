"""Result files people read and plot: JSON, CSV, PNG figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: runs on servers and in CI without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Circle  # noqa: E402

from ..files import write_atomically  # noqa: E402


def write_json_atomic(path: str | Path, payload: Any) -> None:
    """Write JSON so that a reader never sees a half-written file."""
    text = json.dumps(payload, indent=2, sort_keys=False, default=_json_default)
    # results are for people to read (mkstemp makes 0600); a lost rewrite is redone next round
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")), durable=False,
                     mode=0o644)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def plot_projection(
    points: np.ndarray, true_clusters: list[int], means: np.ndarray, radii: np.ndarray,
    path: str | Path, title: str,
) -> Path:
    """The paper's Fig. 5: round-1 updates in the 2-D projection, coloured by true cluster,
    with each fitted GMM component drawn as its mean and a circle of radius r_m."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    colours = plt.get_cmap("tab10")
    truth = np.asarray(true_clusters)
    for cluster in sorted(set(truth.tolist())):
        members = points[truth == cluster]
        ax.scatter(members[:, 0], members[:, 1], color=colours(cluster % 10), s=40,
                   label=f"true cluster {cluster} ({len(members)})", edgecolor="black")
    for index, (mean, radius) in enumerate(zip(means, radii, strict=True)):
        ax.add_patch(Circle(tuple(mean[:2]), radius, fill=False, linestyle="--", color="grey"))
        ax.plot(mean[0], mean[1], marker="x", color="black")
        ax.annotate(f"m{index}", tuple(mean[:2]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("PC 1 (scaled)")
    ax.set_ylabel("PC 2 (scaled)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.set_aspect("equal", adjustable="datalim")
    return save_figure(fig, path)


def plot_accuracy_by_cluster(
    rounds: list[dict[str, Any]], true_clusters: dict[int, int], path: str | Path, title: str,
) -> Path:
    """Mean test accuracy of the silos of each true cluster at every evaluated round."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = plt.get_cmap("tab10")
    evaluated = [r for r in rounds if r.get("test_accuracy")]
    for cluster in sorted(set(true_clusters.values())):
        members = [p for p, c in true_clusters.items() if c == cluster]
        xs, ys = [], []
        for row in evaluated:
            values = [row["test_accuracy"][str(p)] for p in members  # None: unknown
                      if row["test_accuracy"].get(str(p)) is not None]
            if values:
                xs.append(row["round"])
                ys.append(100 * float(np.mean(values)))
        ax.plot(xs, ys, marker="o", color=colours(cluster % 10),
                label=f"cluster {cluster} ({len(members)} silos)")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
