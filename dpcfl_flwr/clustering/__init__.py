"""Server-side clustering of DP model updates.

docs/algorithm.md#stage-1-clustering-the-round-1-updates (equations A4-A8);
docs/algorithm.md#noise-aware-clustering for silos whose noise differs (A12-A16).
"""

from .blocks import StackedRows
from .gmm import (
    GMMFit,
    UpdateClusterer,
    fit_spherical_gmm,
    load_mixture_code,
    overlap,
    project_updates,
    scale_points,
    separation_scores,
    switch_round,
)
from .noise_aware import (
    NoiseAwareClusterer,
    combine_noise,
    debiased_projection,
    fit_noise_aware_gmm,
    residual_noise_variances,
    update_gram,
)

__all__ = [
    "GMMFit", "NoiseAwareClusterer", "StackedRows", "UpdateClusterer", "combine_noise",
    "debiased_projection", "fit_noise_aware_gmm", "fit_spherical_gmm", "load_mixture_code",
    "overlap", "project_updates",
    "residual_noise_variances", "scale_points", "separation_scores", "switch_round",
    "update_gram",
]
