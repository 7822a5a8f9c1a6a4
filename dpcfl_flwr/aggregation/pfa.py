"""PFA (Liu et al. 2021, "Projected federated averaging"), a baseline of paper 002 (Table 1,
App. B.3; docs/aggregation.md#pfa).

Silos claiming large budgets ("public") carry little noise, so their updates span a cleaner
subspace; PFA projects every other ("private") update onto the top principal direction of the
public ones, then averages all updates with claimed-epsilon weights, as WeiAvg does. Split:
a two-component Gaussian mixture on the min-max-scaled claims, public = the component with
the larger mean. Projection dimension 1, as paper 002 uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .fact_rules import epsilon_weights
from .facts import Combination, RuleSettings, UpdateFacts


def public_silos(claims: np.ndarray, seed: int) -> np.ndarray:
    """Boolean mask of the "public" silos: the mixture component with the larger mean of a
    GMM(2) on min-max-scaled claimed epsilons (needs >= 2 distinct claims)."""
    scaled = (claims - claims.min()) / (claims.max() - claims.min())
    from sklearn.mixture import GaussianMixture  # only a PFA run pays for the import

    mixture = GaussianMixture(n_components=2, random_state=seed).fit(scaled.reshape(-1, 1))
    labels = mixture.predict(scaled.reshape(-1, 1))
    return np.asarray(labels == int(np.argmax(mixture.means_.ravel())))


def project_on_public(public: np.ndarray, private: np.ndarray) -> np.ndarray:
    """Reconstruct each private update (rows) from the first principal component of the
    public updates (rows), in coordinates standardised across the public silos.

    Standardising per coordinate uses the public mean and (population) standard deviation;
    a coordinate on which the public silos agree exactly keeps scale 1.
    """
    mean = public.mean(axis=0)
    scale = public.std(axis=0)
    scale[scale == 0] = 1.0
    standard = (public - mean) / scale
    # Top right singular vector of the k x p public matrix through its k x k Gram matrix.
    _, vectors = np.linalg.eigh(standard @ standard.T)
    direction = standard.T @ vectors[:, -1]
    length = float(np.linalg.norm(direction))
    coords = (private - mean) / scale
    if length == 0.0:  # identical public updates: the subspace is their common point
        return np.broadcast_to(mean, private.shape).copy()
    direction /= length
    return np.outer(coords @ direction, direction) * scale + mean


def pfa(updates: np.ndarray, facts: Sequence[UpdateFacts], settings: RuleSettings) -> Combination:
    """Claimed-epsilon weights over updates whose private ones are projected; WeiAvg without
    projection (``fallback`` says why) when the claims do not split into two groups or
    fewer than two silos are public."""
    weights = epsilon_weights(facts)
    claims = np.array([f.claimed_epsilon for f in facts], dtype=np.float64)
    if np.unique(claims).size < 2:
        return Combination(weights, updates, None,
                           "pfa: fewer than 2 distinct claimed epsilons; weiavg, no projection")
    public = public_silos(claims, settings.seed)
    if public.sum() < 2:
        return Combination(weights, updates, None,
                           f"pfa: {int(public.sum())} public silo(s), need 2 for a principal "
                           "direction; weiavg, no projection")
    combined = np.array(updates, dtype=np.float64, copy=True)
    if not public.all():
        combined[~public] = project_on_public(combined[public], combined[~public])
    return Combination(weights, combined, None, None)
