"""Server-side clustering of DP model updates.

docs/algorithm.md#stage-1-clustering-the-round-1-updates (equations A4-A8).
"""

from .gmm import (
    GMMFit,
    UpdateClusterer,
    fit_spherical_gmm,
    overlap,
    project_updates,
    scale_points,
    separation_scores,
    switch_round,
)

__all__ = [
    "GMMFit", "UpdateClusterer", "fit_spherical_gmm", "overlap", "project_updates",
    "scale_points", "separation_scores", "switch_round",
]
