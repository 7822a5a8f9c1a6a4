"""The privacy budgets and batch sizes of paper 002's 20-silo experiments (App. B.2, Table 7).

Table 7 names nine epsilon distributions (Dist1-Dist9) whose parameters the paper leaves out;
these are the paper's released per-client settings for n = 20 (one epsilon per silo, in silo
order), with the batch size each silo uses, drawn once from {16, 32, 64, 128} and used with
every Dist. Simulation presets read them to reproduce the paper's heterogeneous budgets.
For CIFAR100 the paper multiplies every epsilon by 10.
"""

from __future__ import annotations

DISTRIBUTIONS: dict[str, tuple[float, ...]] = {
    "dist1": (2.81, 1.69, 1.74, 1.46, 2.43, 0.85, 2.87, 1.62, 2.16, 1.88,
              2.73, 0.97, 1.84, 1.81, 2.57, 1.45, 1.91, 1.56, 2.02, 2.29),
    "dist2": (5.45, 1.0, 1.15, 0.2, 4.52, 4.88, 0.98, 0.2, 1.05, 0.93,
              1.0, 0.21, 0.21, 1.27, 0.89, 1.17, 0.96, 0.89, 1.04, 0.84),
    "dist3": (2.2, 3.66, 0.2, 1.65, 0.9, 0.64, 1.09, 1.86, 2.1, 2.79,
              2.21, 3.49, 1.18, 4.41, 0.33, 3.42, 2.2, 2.88, 0.87, 1.15),
    "dist4": (0.57, 0.66, 0.42, 3.97, 3.27, 0.45, 0.55, 2.58, 1.82, 0.64,
              0.19, 2.38, 0.34, 0.44, 0.47, 0.5, 0.56, 0.51, 0.68, 0.19),
    "dist5": (0.95, 1.5, 0.2, 0.74, 0.46, 0.37, 0.54, 0.82, 0.91, 1.17,
              0.95, 1.43, 0.57, 1.78, 0.25, 1.41, 0.95, 1.21, 0.45, 0.56),
    "dist6": (0.5, 0.46, 0.39, 0.44, 0.21, 0.36, 0.19, 0.51, 1.12, 0.2,
              0.49, 0.19, 0.19, 0.2, 0.2, 0.18, 0.61, 0.15, 0.38, 0.53),
    "dist7": (0.26, 0.82, 0.55, 0.78, 0.98, 0.63, 0.6, 0.26, 0.41, 0.6,
              0.74, 0.84, 0.5, 0.25, 0.43, 0.93, 0.37, 0.56, 0.94, 0.22),
    "dist8": (0.2, 0.2, 0.19, 0.44, 0.21, 0.19, 0.19, 0.51, 0.62, 0.2,
              0.2, 0.19, 0.19, 0.2, 0.2, 0.18, 0.61, 0.17, 0.38, 0.53),
    "dist9": (0.45, 0.25, 0.22, 0.31, 0.28, 0.36, 0.29, 0.29, 0.23, 0.27,
              0.48, 0.28, 0.42, 0.46, 0.44, 0.26, 0.25, 0.21, 0.21, 0.26),
}

PAPER_BATCH_SIZES: tuple[int, ...] = (
    32, 64, 16, 32, 16, 16, 16, 32, 32, 64, 32, 64, 16, 128, 16, 64, 32, 64, 16, 16,
)
