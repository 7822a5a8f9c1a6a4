"""Server-side clustering of DP model updates (spec §2.6)."""

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
