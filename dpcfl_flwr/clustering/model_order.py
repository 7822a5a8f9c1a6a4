"""How many clusters the round-1 updates hold: each candidate M against a null of no structure.

docs/algorithm.md#choice-of-m states the rule; this module computes it.

Picking M by the largest MSS alone prefers many small clusters: a component of one or two
silos has a radius near zero, so its separation from the rest is large whatever the data.
Measured on Fashion-MNIST exported to 10 silos of 400 records, that rule split three groups
into 8-9 clusters, and 10 silos with i.i.d. records into 9.

Here every candidate's MSS is set beside the MSS the *same* fit reaches on updates that hold
no structure: each silo's update replaced by the mean of all updates plus Gaussian noise of
its own variance v_i, which its noise plan states (or its update's spread, where no plan
came). That is a parametric bootstrap of the null hypothesis "one cluster", the way
McLachlan (1987, Applied Statistics 36(3)) calibrates a statistic for the number of
components of a normal mixture; here the statistic is the MSS, which the rest of the method
already reads. The evidence for M is how far log MSS lies above its null draws, in units of
their standard deviation. A candidate passes where that evidence reaches ``threshold`` and
its MSS exceeds every null draw; M is the passing candidate whose MSS is the largest multiple
of its null's median; with none passing, M = 1, one cluster.

All of it reads the round-1 updates the server already holds and simulated noise: it is
post-processing of DP outputs and costs no privacy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .blocks import UpdateMatrix, column_blocks
from .gmm import UpdateClusterer
from .noise_aware import residual_noise_variances, update_gram

#: Null draws per fit: at 10 silos and the CNN each costs one fit of every candidate on a
#: 10 x 50,000 matrix (about 0.1 s).
NULL_DRAWS = 40
#: Log-MSS standard deviations above the null's mean an M needs: with 9 candidates and
#: Gaussian tails, about 1% of structureless federations would pass by chance.
EVIDENCE_THRESHOLD = 3.0
#: Columns a null draw simulates: the MSS of n noisy points depends on p only through
#: p >> n, so a ResNet's 11 million coordinates need not all be drawn.
NULL_COLUMNS = 50_000


@dataclass(frozen=True)
class ModelOrder:
    """The chosen M and the figures behind it.

    ``evidence``: per candidate M, (log MSS - mean of the null's log MSS) / its sd;
    ``null_mss``: per candidate, the null draws' 95% quantile of MSS."""

    n_clusters: int
    evidence: dict[int, float]
    null_mss: dict[int, float]


def noise_variances(updates: UpdateMatrix,
                    reported: Sequence[float | None] | None) -> np.ndarray:
    """v_i per silo, in the updates' units: its reported plan, else its update's spread off
    the other updates' span (:func:`.noise_aware.residual_noise_variances`)."""
    known = [] if reported is None else list(reported)
    if known and all(v is not None and v > 0 for v in known):
        return np.asarray(known, dtype=float)
    gram, trained = update_gram(updates)
    estimated = residual_noise_variances(gram, trained)
    if not known:
        return estimated
    return np.array([e if v is None or not v > 0 else v
                     for v, e in zip(known, estimated, strict=True)])


def mean_update(updates: UpdateMatrix, columns: np.ndarray) -> np.ndarray:
    """The mean of all updates, at the given column indices (sorted), one block at a time."""
    means = []
    for start, block in _offsets(updates):
        inside = columns[(columns >= start) & (columns < start + block.shape[1])] - start
        means.append(block[:, inside].mean(axis=0))
    return np.concatenate(means)


def null_columns(updates: UpdateMatrix, rng: np.random.Generator,
                 limit: int = NULL_COLUMNS) -> np.ndarray:
    """The coordinates the null draws simulate: all of them, or ``limit`` drawn at random
    among those some update moves (a frozen parameter gets no noise)."""
    moved = np.concatenate([
        np.flatnonzero(np.any(block != 0, axis=0)) + offset
        for offset, block in _offsets(updates)])
    if len(moved) <= limit:
        return moved
    return np.sort(rng.choice(moved, size=limit, replace=False))


def _offsets(updates: UpdateMatrix) -> list[tuple[int, np.ndarray]]:
    out, start = [], 0
    for block in column_blocks(updates):
        out.append((start, block))
        start += block.shape[1]
    return out


def null_candidate_mss(
    candidate_mss: Callable[[np.ndarray, np.ndarray], Mapping[int, float]],
    centre: np.ndarray, variances: np.ndarray, draws: int, rng: np.random.Generator,
) -> dict[int, np.ndarray]:
    """Per candidate M, the MSS of ``draws`` structureless federations: silo i's update is
    ``centre`` plus N(0, v_i) per coordinate. ``candidate_mss(updates, variances)`` fits
    them as the real updates were fitted and returns M -> MSS."""
    std = np.sqrt(variances)[:, None]
    found: dict[int, list[float]] = {}
    for _ in range(draws):
        noisy = centre[None, :] + rng.standard_normal((len(variances), len(centre))) * std
        for m, mss in candidate_mss(noisy.astype(np.float32), variances).items():
            found.setdefault(m, []).append(mss)
    return {m: np.asarray(values) for m, values in found.items()}


def choose_model_order(observed: Mapping[int, float], null: Mapping[int, np.ndarray],
                       threshold: float = EVIDENCE_THRESHOLD,
                       smallest: Mapping[int, int] | None = None) -> ModelOrder:
    """M from the observed MSS per candidate and its null draws (module docstring).

    ``smallest``: per candidate, the silos in its fit's smallest cluster; a fit with a
    cluster of one silo cannot pass, whatever its MSS: a component's radius needs two silos
    to be measured, and one silo's tiny radius is what makes MSS large for fits of many
    clusters whether or not the clusters are real."""
    evidence: dict[int, float] = {}
    quantiles: dict[int, float] = {}
    margin: dict[int, float] = {}
    for m, mss in observed.items():
        draws = np.log(np.maximum(null[m], 1e-300))
        spread = max(float(draws.std()), 1e-6)
        evidence[m] = (math.log(max(mss, 1e-300)) - float(draws.mean())) / spread
        quantiles[m] = float(np.quantile(null[m], 0.95))
        alone = smallest is not None and smallest[m] < 2
        if evidence[m] >= threshold and mss > float(null[m].max()) and not alone:
            margin[m] = math.log(max(mss, 1e-300)) - float(np.median(draws))
    # Among the candidates noise cannot explain, the one whose MSS is the largest multiple of
    # what noise gives it: the null's spread narrows as M grows, so a small excess over a
    # narrow null can score as many standard deviations as a large one over a wide null.
    chosen = max(margin, key=lambda m: (margin[m], -m)) if margin else 1
    return ModelOrder(chosen, evidence, quantiles)


def fit_model_order(clusterer: UpdateClusterer, updates: UpdateMatrix,
                    reported: Sequence[float | None] | None = None,
                    draws: int = NULL_DRAWS, threshold: float = EVIDENCE_THRESHOLD,
                    seed: int = 0) -> ModelOrder:
    """Fit ``clusterer`` (its ``n_clusters`` None) on the round-1 updates, then keep the M
    the null of no structure supports (module docstring).

    ``reported``: each silo's planned noise variance in the updates' units (None where a
    silo sent none); ``draws``: null federations simulated; ``seed``: their generator."""
    if clusterer.n_clusters is not None:
        raise ValueError("the number of clusters is given; there is no M to choose")
    clusterer.fit(updates, reported)
    variances = getattr(clusterer, "noise_variances_", None)
    if variances is None:
        variances = noise_variances(updates, reported)
    rng = np.random.default_rng(seed)
    columns = null_columns(updates, rng)
    twin = copy.copy(clusterer)  # same settings; its fits of the null overwrite only its own

    def candidate_mss(noisy: np.ndarray, v: np.ndarray) -> dict[int, float]:
        return twin.fit(noisy, list(v)).candidate_mss_

    null = null_candidate_mss(candidate_mss, mean_update(updates, columns),
                              np.asarray(variances, dtype=float), draws, rng)
    smallest = {m: int(np.bincount(fit.responsibilities.argmax(axis=1), minlength=m).min())
                for m, fit in clusterer.fits_.items()}
    order = choose_model_order(clusterer.candidate_mss_, null, threshold, smallest)
    clusterer.keep_clusters(order.n_clusters)
    return order
