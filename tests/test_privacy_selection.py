"""The exponential mechanism: its samples follow its softmax, and its limits behave."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dpcfl_flwr.privacy.selection import (
    accuracy_sensitivity,
    select_cluster,
    selection_probabilities,
)


def test_empirical_selection_frequencies_match_softmax_probabilities():
    utilities = [62.0, 55.0, 60.5, 30.0]
    epsilon, sensitivity = 0.3, accuracy_sensitivity(500)
    probabilities = selection_probabilities(utilities, epsilon, sensitivity)
    # Independent formula: exp(eps u / (2 sens)) normalised.
    weights = np.exp(epsilon * np.asarray(utilities) / (2 * sensitivity))
    np.testing.assert_allclose(probabilities, weights / weights.sum(), rtol=1e-12)
    rng = np.random.default_rng(7)
    draws = 40_000
    counts = np.bincount(
        [select_cluster(utilities, epsilon, sensitivity, rng) for _ in range(draws)], minlength=4
    )
    expected = probabilities * draws
    keep = expected > 5  # chi-square needs populated cells; merge the rest
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert np.max(np.abs(counts / draws - probabilities)) < 0.01


def test_large_epsilon_selects_the_most_accurate_cluster():
    utilities = [40.0, 71.0, 70.0]
    rng = np.random.default_rng(0)
    picks = {select_cluster(utilities, 1e4, accuracy_sensitivity(1000), rng) for _ in range(200)}
    assert picks == {1}


def test_tiny_epsilon_selects_almost_uniformly():
    probabilities = selection_probabilities([0.0, 100.0], 1e-6, accuracy_sensitivity(100))
    np.testing.assert_allclose(probabilities, [0.5, 0.5], atol=1e-3)


def test_sensitivity_is_one_record_in_percent():
    assert accuracy_sensitivity(8001) == pytest.approx(100 / 8000)
    with pytest.raises(ValueError):
        accuracy_sensitivity(1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        selection_probabilities([], 1.0, 1.0)
    with pytest.raises(ValueError):
        select_cluster([1.0, 2.0], 0.0, 1.0)
