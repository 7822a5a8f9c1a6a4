"""Paper 004 §4.1 on our code: FedAvg, IFCA and the d-private clustered algorithm (v = 5) on
the two-line regression mixture (bench/regression_mixture.py, docs/dprivacy.md).

Draws the paper's Figure 1 (hypotheses' trajectories against the two optima over the released
models, loss per round) and Figure 2 (largest cumulative leakage per group) for one seed to
``bench/figures/dprivacy-synthetic.png``, and tabulates the final figures over a sweep of
seeds, since one run of the d-private algorithm can lose a hypothesis to an outlier release.

    python bench/dprivacy_synthetic.py [--seed 2] [--seeds 20] [--rounds 60] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from bench.regression_mixture import (  # noqa: E402
    ALGORITHMS,
    OPTIMA,
    SyntheticSetup,
    Trajectory,
    distance_to_optima,
    max_leakage_per_group,
    run,
)

FIGURE = Path(__file__).with_name("figures") / "dprivacy-synthetic.png"
NEAR = 1.0  # "near an optimum": within 1.0 (the optima are 10.5 apart)
LOST = 3.0  # farther than this, a hypothesis has left its optimum, not just jittered round it
COLOURS = ("tab:blue", "tab:orange")


def _trajectory_panel(ax: plt.Axes, trajectory: Trajectory) -> None:
    released = trajectory.released.reshape(-1, 2)
    ax.scatter(released[:, 0], released[:, 1], s=4, color="0.6", alpha=0.4,
               label="released models")
    for j in range(trajectory.hypotheses.shape[1]):
        path = trajectory.hypotheses[:, j]
        ax.plot(path[:, 0], path[:, 1], "-o", ms=2, lw=1, color=COLOURS[j],
                label=f"hypothesis {j + 1}")
    ax.scatter(OPTIMA[:, 0], OPTIMA[:, 1], marker="*", s=160, color="black", zorder=5,
               label="optima")
    ax.set_xlim(-12, 18)
    ax.set_ylim(-16, 16)
    ax.set_title(trajectory.algorithm.name, fontsize=9)
    ax.set_xlabel("theta[0]")
    ax.set_ylabel("theta[1]")
    ax.grid(alpha=0.3)


def draw(runs: dict[str, Trajectory], sweep: dict[str, np.ndarray], seed: int) -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(13, 8))
    for ax, trajectory in zip(axes[0], runs.values(), strict=True):
        _trajectory_panel(ax, trajectory)
    axes[0][0].legend(fontsize=7, loc="lower left")
    loss = axes[1][0]
    for trajectory in runs.values():
        loss.plot(trajectory.loss, label=trajectory.algorithm.name)
    loss.set_yscale("log")
    loss.set_xlabel("round")
    loss.set_ylabel("validation RMSE (Eq. 15)")
    loss.set_title(f"loss per round (seed {seed})", fontsize=9)
    loss.legend(fontsize=7)
    loss.grid(alpha=0.3)
    leak = axes[1][1]
    per_group = max_leakage_per_group(runs["dprivacy"])
    for g in range(per_group.shape[1]):
        leak.step(range(len(per_group)), per_group[:, g], where="post", color=COLOURS[g],
                  label=f"users of optimum {OPTIMA[g].tolist()}")
    leak.set_xlabel("round")
    leak.set_ylabel("max cumulative leakage (sum of n/v)")
    leak.set_title("d-private run: largest leakage per group (Fig. 2)", fontsize=9)
    leak.legend(fontsize=7)
    leak.grid(alpha=0.3)
    spread = axes[1][2]
    for i, distances in enumerate(sweep.values()):
        jitter = np.random.default_rng(i).uniform(-0.15, 0.15, len(distances))
        spread.scatter(np.full(len(distances), i) + jitter, distances, s=12)
    spread.axhline(NEAR, color="0.4", ls="--", lw=1)
    spread.set_yscale("log")
    spread.set_xticks(range(len(sweep)), [ALGORITHMS[n].name.split(" (")[0] for n in sweep])
    spread.set_ylabel("final distance, farthest optimum\nto its nearest hypothesis")
    spread.set_title(f"over {len(next(iter(sweep.values())))} seeds", fontsize=9)
    spread.grid(alpha=0.3)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)
    plt.close(fig)
    return FIGURE


def _row(name: str, figure_run: Trajectory, finals: list[Trajectory]) -> str:
    distances = np.array([distance_to_optima(t.hypotheses[-1]).max() for t in finals])
    losses = np.array([t.loss[-1] for t in finals])
    leakage = np.array([t.leakage[-1].max() for t in finals])
    leak = "no guarantee (v = 0)" if np.isinf(leakage).any() else (
        f"{figure_run.leakage[-1].max():.1f} ({np.median(leakage):.1f})")
    hypotheses = "; ".join(f"[{h[0]:.2f}, {h[1]:.2f}]" for h in figure_run.hypotheses[-1])
    return (f"| {figure_run.algorithm.name} | {hypotheses} | "
            f"{distance_to_optima(figure_run.hypotheses[-1]).max():.2f} | "
            f"{figure_run.loss[-1]:.3f} | {leak} | {np.median(distances):.2f} | "
            f"{int(np.sum(distances < NEAR))}/{len(finals)} | {np.median(losses):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=2, help="the run drawn in the figure")
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 of the sweep")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    setup = SyntheticSetup(rounds=args.rounds)
    start = time.perf_counter()
    runs = {name: run(algorithm, setup, args.seed) for name, algorithm in ALGORITHMS.items()}
    finals = {name: [run(algorithm, setup, s) for s in range(args.seeds)]
              for name, algorithm in ALGORITHMS.items()}
    sweep = {name: np.array([distance_to_optima(t.hypotheses[-1]).max() for t in trs])
             for name, trs in finals.items()}
    draw(runs, sweep, args.seed)
    seconds = time.perf_counter() - start
    rows = [_row(name, runs[name], finals[name]) for name in ALGORITHMS]
    failed = [s for s, d in enumerate(sweep["dprivacy"]) if d >= NEAR]
    lost = [s for s in failed if sweep["dprivacy"][s] >= LOST]
    body = "\n".join([
        f"Two optima {OPTIMA[0].tolist()} and {OPTIMA[1].tolist()}, {setup.users} users x "
        f"{setup.samples} samples (half per optimum), {setup.users_per_round} users per round, "
        f"{setup.rounds} rounds, local SGD E = {setup.epochs}, step {setup.step}, batch "
        f"{setup.batch}; x ~ N(0, I) (the paper does not say). Figure seed {args.seed}; sweep "
        f"over seeds 0-{args.seeds - 1}; {seconds:.1f} s in all.",
        "",
        "| algorithm | final hypotheses (seed) | farthest optimum to its nearest hypothesis "
        "(seed) | final RMSE (seed) | max user leakage, seed (median over seeds) | "
        "farthest distance, median over seeds | seeds near both optima (< 1.0) | "
        "final RMSE, median over seeds |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"![trajectories, loss, leakage](figures/{FIGURE.name})",
        "",
        "Reading: FedAvg's single hypothesis settles between the optima (paper Fig. 1b); IFCA "
        "reaches both (Fig. 1e); the d-private algorithm at v = 5 gets close to both with a "
        "residual error from its noise (Fig. 1h), at a leakage of n/v = 0.4 per participation "
        "(Fig. 2: the curves are flat while the most-sampled users sit out). Where we differ "
        "from the paper's single run: on "
        f"{len(failed)} of {args.seeds} seeds ({', '.join(map(str, failed)) or 'none'}) the "
        "d-private run ends farther than 1.0 from an optimum. On "
        f"{len(lost)} of them ({', '.join(map(str, lost)) or 'none'}) a hypothesis is lost "
        f"(farther than {LOST:.0f}): one release, noised by five times its update, formed a "
        "k-means cluster of its own and threw the hypothesis where no user picks it again; "
        "on the others the noise left a larger residual error. The RMSE floor, about 0.58, is "
        "u's: the model has no intercept and u ~ U[0, 1) has mean 0.5 (sqrt(1/3) = 0.577). "
        "Fixed rounds replace the paper's early "
        "stopping; IFCA here averages by the users' own choices, the d-private algorithm by "
        "k-means seeded at the hypotheses (empty cluster: the hypothesis is kept).",
    ])
    publish("d-privacy: the synthetic experiment of paper 004 (Fig. 1, Fig. 2)", body,
            not args.no_append, bench="dprivacy_synthetic")


if __name__ == "__main__":
    main()
