"""What an aggregation rule is told and what it answers (docs/aggregation.md).

One record per silo update (``UpdateFacts``), one for the rules' knobs (``RuleSettings``) and
one for a rule's answer (``Combination``); every rule in ``rules.py`` reads and writes these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class UpdateFacts:
    """What the server knows about one silo's update in one round.

    ``num_train`` is N_i (records); ``claimed_epsilon`` the epsilon budget the silo claims,
    which the server cannot check (paper 002 §3.3: a silo may lie); ``noise_variance`` the
    true per-coordinate variance of the DP noise in this update (``dp_noise_variance`` of the
    silo's z, b, steps, learning rate and clip norm), or None when the server does not know it.
    """

    partition: int
    num_train: int
    claimed_epsilon: float
    noise_variance: float | None = None


@dataclass(frozen=True)
class RuleSettings:
    """Knobs of the rules that have any (robust-hdp's RPCA, PFA's mixture).

    ``rpca_rows`` is p': RPCA sees the first p' coordinates of each update (the paper's first
    row block, 002 §3.6), the whole vector when p <= p'. Below ``rpca_min_silos`` updates in a
    cluster robust-hdp falls back to "samples" weights, since a low-rank + sparse split of a
    handful of columns says little. ``rpca_tol`` is relative: stop when ||M - L - S||_F <=
    tol ||M||_F. ``rpca_max_iter``: the solver took 50-70 iterations on 28,938 x 20 update
    matrices; 500 bounds a bad case at a few seconds. ``seed`` seeds PFA's Gaussian mixture and
    robust-hdp's groups.

    ``rpca_work_limit`` bounds p' n^2, the multiply-adds of one RPCA iteration's Gram matrix
    for a cluster of n silos: above it, p' drops to ``rpca_auto_rows`` (the first rows
    still, docs/aggregation.md#cost-at-many-silos), the tolerance rises to
    ``rpca_auto_tol``, and a cluster of more than ``rpca_auto_group`` silos is decomposed
    in groups of at most that many (drawn with ``seed``). 4e8 leaves the paper's sizes
    exact (20 silos with p' = 200,000 is 8e7; the CNN stays whole up to 117 silos in a
    cluster) and takes the 143-286-silo clusters of 1,000 silos from 40-58 CPU seconds a
    round to 1-2, the weighted average's noise within 0.5% of the whole update's
    (bench/RESULTS.md, "Scaling: the server's work per round"). None: p', the tolerance
    and the groups are ``rpca_rows``, ``rpca_tol`` and the whole cluster whatever n."""

    rpca_rows: int = 200_000
    rpca_work_limit: float | None = 4e8
    rpca_auto_rows: int = 1_000
    rpca_auto_tol: float = 1e-5
    rpca_auto_group: int = 100
    rpca_min_silos: int = 5
    rpca_max_iter: int = 500
    rpca_tol: float = 1e-7
    seed: int = 0


DEFAULT_SETTINGS = RuleSettings()  # frozen, so one shared default is safe


@dataclass
class Combination:
    """A rule's answer for one cluster: the new model is old + sum_i weights[i] updates[i].

    ``weights`` (n,) float64, non-negative, sum 1, in the order of the updates given;
    ``updates`` (n, p) the updates to average (PFA's projected private updates, otherwise the
    inputs); ``estimated_variance`` robust-hdp's sigma_hat_i^2 per coordinate
    (||S_i||^2 / rows used), None for other rules; ``fallback`` one line saying why the rule
    used another rule's weights, None when it did not.
    """

    weights: np.ndarray
    updates: np.ndarray
    estimated_variance: np.ndarray | None = None
    fallback: str | None = None
