"""The registry of aggregation rules and the one entry point, ``combine`` (paper 002 Table 1;
docs/aggregation.md).

A rule maps one cluster's updates (n, p) and what the server knows of them to weights and the
updates to average. Adding a rule: write it (updates, facts, settings) -> Combination and list
it in ``_RULES``; tests/test_aggregation_rules.py checks every listed rule's contract.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from . import fact_rules
from .facts import DEFAULT_SETTINGS, Combination, RuleSettings, UpdateFacts
from .pfa import pfa
from .robust_hdp import robust_hdp

log = logging.getLogger(__name__)

Rule = Callable[[np.ndarray, Sequence[UpdateFacts], RuleSettings], Combination]

_RULES: dict[str, Rule] = {
    "uniform": lambda u, f, s: fact_rules.uniform(u, f),
    "samples": lambda u, f, s: fact_rules.samples(u, f),
    "robust-hdp": robust_hdp,
    "weiavg": lambda u, f, s: fact_rules.weiavg(u, f),
    "pfa": pfa,
    # The silos calibrate z for min_j eps_j; the server weighs by N_i as DP-FedAvg does.
    "min-eps": lambda u, f, s: fact_rules.samples(u, f),
    "oracle-variance": lambda u, f, s: fact_rules.oracle_variance(u, f),
}

RULES: tuple[str, ...] = tuple(_RULES)


def combine(
    rule: str, updates: np.ndarray, facts: Sequence[UpdateFacts],
    settings: RuleSettings = DEFAULT_SETTINGS,
) -> Combination:
    """Weights (and the updates to average) for one cluster under ``rule``.

    ``updates`` is (n, p), row i the update of the silo ``facts[i]`` describes. Raises
    ValueError for an unknown rule, mismatched shapes, non-finite updates, or facts a rule
    needs and does not have. A fallback is logged and returned in ``Combination.fallback``.
    """
    if rule not in _RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; expected one of {', '.join(RULES)}")
    matrix = np.asarray(updates)
    if matrix.ndim != 2 or matrix.shape[0] != len(facts) or matrix.shape[0] == 0:
        raise ValueError(f"updates must be (n, p) with n = {len(facts)} silos (n > 0), "
                         f"got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        bad = [f.partition for f, row in zip(facts, matrix, strict=True)
               if not np.all(np.isfinite(row))]
        raise ValueError(f"non-finite values in the updates of silo(s) {bad}")
    combination = _RULES[rule](matrix, facts, settings)
    if combination.fallback is not None:
        log.info("aggregation fell back: %s", combination.fallback)
    return combination
