"""The synthetic experiment of paper 004 §4.1: a mixture of two linear regressions, learned by
FedAvg, IFCA and the d-private clustered algorithm (paper 004 Alg. 1). Pure numpy, no Flower.

The setting, and where the paper leaves a choice to us:

- Two optima ``[5, 6]`` and ``[4, -4.5]``; a user's sample is ``y = x^T theta* + u`` with
  ``u ~ U[0, 1)`` (the paper). The paper does not give the law of ``x``: we draw
  ``x ~ N(0, I_2)``. The model has no intercept (n = 2, as the paper's leakage 2/5 implies).
- 100 users of 10 samples each; exactly half of the users per optimum (the paper says "either
  one of the distributions"; we fix the halves rather than toss a coin per user). A held-out
  set of users of the same make-up measures the loss (Eq. 15, RMSE), each validation user
  scored on the hypothesis that fits it best.
- 7 users per round, drawn without replacement; local SGD for E = 1 epoch, step 0.1, batch 10
  on half the mean squared error (the RMSE's minimiser, with a gradient that does not blow
  up near a perfect fit). k hypotheses start from N(0, I).
- A fixed number of rounds (``rounds``) instead of the paper's early stopping (no gain in
  6 validation rounds), so that the three algorithms' curves share one axis.
- The server (Alg. 1): k-means on the released models, seeded at the current hypotheses, run
  to a fixed point; each hypothesis becomes the mean of its cluster, and an empty cluster
  keeps its hypothesis (the paper does not say; spec D.B5). IFCA, as in its own paper,
  averages by the users' own choices instead (``server="choices"``). FedAvg is k = 1.
- v = 0 means no sanitiser (FedAvg, IFCA): such a release has no d-privacy guarantee, and
  its leakage is recorded as ``inf``. With v > 0 every participation costs n / v (0.4 at v = 5).

Randomness comes from one seed (data, starting hypotheses, sampling, noise: four streams),
so the same seed gives the three algorithms the same users and the same starting points. A
simulation may seed its noise; a silo never does (a seed the server knew would undo it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from dpcfl_flwr.privacy.dprivacy import sanitize_update

OPTIMA = np.array([[5.0, 6.0], [4.0, -4.5]])
"""theta_1*, theta_2* of paper 004 §4.1."""

Server = Literal["kmeans", "choices"]


@dataclass(frozen=True)
class SyntheticSetup:
    """The experiment's sizes and local training (paper 004 App., "Synthetic Data")."""

    users: int = 100
    samples: int = 10
    validation_users: int = 100
    users_per_round: int = 7
    rounds: int = 60
    epochs: int = 1
    step: float = 0.1
    batch: int = 10


@dataclass(frozen=True)
class Algorithm:
    """One of the compared algorithms: k hypotheses, noise multiplier v, server rule."""

    name: str
    k: int
    noise_multiplier: float
    server: Server = "kmeans"


ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm("FedAvg", k=1, noise_multiplier=0.0),
    "ifca": Algorithm("IFCA", k=2, noise_multiplier=0.0, server="choices"),
    "dprivacy": Algorithm("d-private (Alg. 1, v = 5)", k=2, noise_multiplier=5.0),
}


@dataclass
class Users:
    """Each user's samples ``x`` (users, samples, 2), ``y`` (users, samples) and its true
    distribution ``group`` (index into :data:`OPTIMA`)."""

    x: np.ndarray
    y: np.ndarray
    group: np.ndarray


@dataclass
class Trajectory:
    """A run, round by round (row 0 is before the first round).

    ``hypotheses`` (rounds + 1, k, 2); ``released`` (rounds, U, 2), the models the sampled
    users sent; ``chosen`` (rounds, U), their chosen hypothesis; ``sampled`` (rounds, U),
    their indices; ``loss`` (rounds + 1,), the validation RMSE (Eq. 15); ``leakage``
    (rounds + 1, users), each user's cumulative d-privacy leakage (sum of n / v, Thm 3.1;
    ``inf`` once a user released without sanitiser); ``group`` (users,), the true optimum.
    """

    algorithm: Algorithm
    hypotheses: np.ndarray
    released: np.ndarray
    chosen: np.ndarray
    sampled: np.ndarray
    loss: np.ndarray
    leakage: np.ndarray
    group: np.ndarray
    empty_clusters: int = 0
    notes: list[str] = field(default_factory=list)


def make_users(count: int, samples: int, rng: np.random.Generator) -> Users:
    """``count`` users, the first half on optimum 0 and the rest on optimum 1."""
    group = (np.arange(count) >= (count + 1) // 2).astype(int)
    x = rng.standard_normal((count, samples, OPTIMA.shape[1]))
    noise = rng.uniform(0.0, 1.0, (count, samples))
    y = np.einsum("usd,ud->us", x, OPTIMA[group]) + noise
    return Users(x=x, y=y, group=group)


def rmse(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Paper 004 Eq. 15 for each hypothesis in ``theta`` (k, 2) on one user's data: (k,)."""
    residuals = x @ np.atleast_2d(theta).T - y[:, None]
    return np.sqrt(np.mean(residuals**2, axis=0))


def local_update(theta: np.ndarray, x: np.ndarray, y: np.ndarray, setup: SyntheticSetup,
                 rng: np.random.Generator) -> np.ndarray:
    """E epochs of mini-batch SGD on half the mean squared error, from ``theta``."""
    theta = theta.astype(float).copy()
    for _ in range(setup.epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), setup.batch):
            rows = order[start:start + setup.batch]
            residual = x[rows] @ theta - y[rows]
            theta -= setup.step * x[rows].T @ residual / len(rows)
    return theta


def kmeans_labels(points: np.ndarray, centres: np.ndarray,
                  max_iterations: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means from ``centres`` to a fixed point; an empty cluster keeps its centre
    (spec D.B5). Returns the labels of ``points`` and the final centres."""
    centres = centres.astype(float).copy()
    labels = np.full(len(points), -1)
    for _ in range(max_iterations):
        distances = np.linalg.norm(points[:, None, :] - centres[None, :, :], axis=2)
        new = distances.argmin(axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(len(centres)):
            if np.any(labels == j):
                centres[j] = points[labels == j].mean(axis=0)
    return labels, centres


def server_update(hypotheses: np.ndarray, released: np.ndarray, chosen: np.ndarray,
                  server: Server) -> tuple[np.ndarray, int]:
    """The next hypotheses: each the mean of its cluster's released models, the clusters from
    k-means seeded at ``hypotheses`` (Alg. 1) or from the users' choices (IFCA). Returns
    them and the number of empty clusters (which kept their hypothesis)."""
    if server == "kmeans":
        labels, _ = kmeans_labels(released, hypotheses)
    else:
        labels = chosen
    updated = hypotheses.copy()
    empty = 0
    for j in range(len(hypotheses)):
        members = labels == j
        if members.any():
            updated[j] = released[members].mean(axis=0)
        else:
            empty += 1
    return updated, empty


def validation_loss(hypotheses: np.ndarray, users: Users) -> float:
    """Mean over the users of the RMSE of the hypothesis that fits each best."""
    return float(np.mean([rmse(hypotheses, x, y).min() for x, y in zip(users.x, users.y,
                                                                          strict=True)]))


def run(algorithm: Algorithm, setup: SyntheticSetup = SyntheticSetup(),
        seed: int = 0) -> Trajectory:
    """One run of ``algorithm`` on the seeded synthetic mixture (paper 004 Alg. 1)."""
    data_rng, init_rng, sample_rng, noise_rng = (np.random.default_rng(s) for s in
                                                 np.random.SeedSequence(seed).spawn(4))
    users = make_users(setup.users, setup.samples, data_rng)
    held_out = make_users(setup.validation_users, setup.samples, data_rng)
    hypotheses = init_rng.standard_normal((algorithm.k, OPTIMA.shape[1]))
    n = OPTIMA.shape[1]
    per_release = n / algorithm.noise_multiplier if algorithm.noise_multiplier > 0 else math.inf
    history = [hypotheses.copy()]
    losses = [validation_loss(hypotheses, held_out)]
    leakage = np.zeros((setup.rounds + 1, setup.users))
    released_all, chosen_all, sampled_all = [], [], []
    empty_total = 0
    for t in range(setup.rounds):
        sampled = sample_rng.choice(setup.users, setup.users_per_round, replace=False)
        released, chosen = [], []
        for c in sampled:
            pick = int(rmse(hypotheses, users.x[c], users.y[c]).argmin())
            trained = local_update(hypotheses[pick], users.x[c], users.y[c], setup, sample_rng)
            if algorithm.noise_multiplier > 0:
                trained = sanitize_update(trained, hypotheses[pick],
                                          algorithm.noise_multiplier, noise_rng).released
            released.append(trained)
            chosen.append(pick)
        leakage[t + 1] = leakage[t]
        leakage[t + 1, sampled] += per_release
        hypotheses, empty = server_update(hypotheses, np.array(released), np.array(chosen),
                                          algorithm.server)
        empty_total += empty
        history.append(hypotheses.copy())
        losses.append(validation_loss(hypotheses, held_out))
        released_all.append(released)
        chosen_all.append(chosen)
        sampled_all.append(sampled)
    return Trajectory(algorithm=algorithm, hypotheses=np.array(history),
                      released=np.array(released_all), chosen=np.array(chosen_all),
                      sampled=np.array(sampled_all), loss=np.array(losses), leakage=leakage,
                      group=users.group, empty_clusters=empty_total)


def distance_to_optima(hypotheses: np.ndarray) -> np.ndarray:
    """For each optimum, the distance to its nearest hypothesis in ``hypotheses`` (k, 2)."""
    return np.linalg.norm(OPTIMA[:, None, :] - hypotheses[None, :, :], axis=2).min(axis=1)


def max_leakage_per_group(trajectory: Trajectory) -> np.ndarray:
    """(rounds + 1, 2): the largest cumulative leakage among the users of each true group
    (paper 004 Fig. 2, with the clusters taken as the users' true distributions)."""
    return np.stack([trajectory.leakage[:, trajectory.group == g].max(axis=1)
                     for g in range(len(OPTIMA))], axis=1)
