"""An evaluation's per-class sums, the figures read from them, and their private release.

Each figure is checked against an independent computation: the sums against numpy on the
model's own predictions, balanced accuracy against scikit-learn's
``balanced_accuracy_score``, the histogram's AUROC against ``roc_auc_score`` (exactly on scores
quantised to the bins, within the bin error on the raw scores). The release's L2 sensitivity
is measured by removing every record of a split in turn (and a record the server's weights
make NaN, which reaches the bound); its noise by many draws; the ledger's charge against
Opacus' RDP of the Gaussian mechanism with that sensitivity and noise.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.special import log_softmax, softmax
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch import nn

from dpcfl_flwr.dpsgd.training import classification_sums, evaluation_sums
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyLedger
from dpcfl_flwr.privacy.metrics import (
    LOSS_BOUND,
    SCORE_BINS,
    EvaluationSums,
    auroc,
    auroc_bin_error,
    balanced_accuracy,
    metric_release_cost,
    noisy_release,
    release_sensitivity,
)
from dpcfl_flwr.privacy.rdp import DEFAULT_ORDERS
from dpcfl_flwr.protocol import METRICS, evaluation_fields, evaluation_of
from dpcfl_flwr.strategies.replies import evaluate_reply

FEATURES = 5


def _split(classes: int, n: int, seed: int, weights: list[float]) -> tuple[torch.Tensor, ...]:
    """Records whose label a noisy linear rule gives, drawn with label shares ``weights``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(classes, size=n, p=weights)
    x = rng.normal(size=(n, FEATURES)) + 0.8 * np.eye(classes, FEATURES)[y]
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _model(classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Linear(FEATURES, classes)
    with torch.no_grad():  # the rule, and a lean toward class 0 (recalls then differ)
        model.weight += 2 * torch.eye(classes, FEATURES)
        model.bias[0] += 1.0
    return model


def _outputs(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(x).double().numpy()


@pytest.mark.parametrize("classes, weights", [(3, [0.7, 0.3, 0.0]), (4, [0.4, 0.3, 0.2, 0.1]),
                                              (2, [0.85, 0.15])])
def test_the_sums_and_figures_agree_with_an_independent_computation(classes, weights):
    x, y = _split(classes, 600, classes, weights)
    model = _model(classes, classes)
    sums = classification_sums(model, x, y, classes, batch_size=64)
    logits, labels = _outputs(model, x), y.numpy()
    predicted = logits.argmax(axis=1)
    np.testing.assert_array_equal(sums.class_count, np.bincount(labels, minlength=classes))
    np.testing.assert_array_equal(
        sums.class_correct, np.bincount(labels[predicted == labels], minlength=classes))
    assert sums.correct == int((predicted == labels).sum()) and sums.count == 600
    cross_entropy = -log_softmax(logits, axis=1)[np.arange(600), labels]
    assert sums.loss_sum == pytest.approx(cross_entropy.sum(), rel=1e-5)
    assert evaluation_sums(model, x, y) == pytest.approx((sums.loss_sum, sums.correct))
    with warnings.catch_warnings():  # a class predicted but absent: scikit-learn says so
        warnings.simplefilter("ignore", UserWarning)
        expected = balanced_accuracy_score(labels, predicted)
    assert balanced_accuracy(sums.class_correct, sums.class_count) == pytest.approx(expected)
    assert abs(balanced_accuracy(sums.class_correct, sums.class_count) - sums.accuracy) > 0.01
    if classes != 2:
        assert sums.score_histogram is None
        return
    scores = softmax(logits, axis=1)[:, 1]
    bins = np.minimum(np.floor(scores * SCORE_BINS), SCORE_BINS - 1)
    for k in (0, 1):
        np.testing.assert_array_equal(sums.score_histogram[k],
                                      np.bincount(bins[labels == k].astype(int),
                                                  minlength=SCORE_BINS))
    area = auroc(sums.score_histogram, sums.class_count)
    # the histogram's AUROC is the exact AUROC of the scores quantised to their bins ...
    assert area == pytest.approx(roc_auc_score(labels, bins), abs=1e-12)
    # ... and within the bin error of the raw scores' AUROC
    error = auroc_bin_error(sums.score_histogram)
    assert 0 < error < 0.05
    assert abs(area - roc_auc_score(labels, scores)) <= error
    assert 0.7 < area < 1.0  # the rule is learnable: far from chance


def test_figures_leave_out_absent_classes_and_say_when_there_are_none():
    assert balanced_accuracy(np.array([3, 0, 0]), np.array([4, 0, 2])) == pytest.approx(3 / 8)
    assert balanced_accuracy(np.zeros(3), np.zeros(3)) is None
    one_class = np.zeros((2, SCORE_BINS))
    one_class[0, 4] = 7
    assert auroc(one_class, np.array([7, 0])) is None
    # noisy sums: a class whose total is within two noise deviations counts as absent, a
    # recall out of [0, 1] is clipped
    assert balanced_accuracy(np.array([50.0, 30.0, 3.0]), np.array([40.0, 60.0, 5.0]),
                             noise_std=10.0) == pytest.approx((1.0 + 0.5) / 2)
    # one bin for everything, whichever class: no order to find
    tied = np.zeros((2, SCORE_BINS))
    tied[:, 19] = [30, 10]
    assert auroc(tied, np.array([30, 10])) == 0.5


def _release_vector(sums: EvaluationSums) -> np.ndarray:
    """The vector a private evaluation noises, written out here from its definition."""
    parts = [[sums.correct, sums.loss_sum / LOSS_BOUND], sums.class_correct, sums.class_count]
    if sums.score_histogram is not None:
        parts.append(sums.score_histogram.reshape(-1))
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])


class _NanOnTarget(nn.Module):
    """Weights a server may craft: a finite linear model, except that the record whose first
    feature is 99 gets a NaN logit at class 1 (its own class)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.inner(x)
        target = (x[:, 0] == 99).unsqueeze(1) & (torch.arange(logits.shape[1]) == 1)
        return torch.where(target, torch.full_like(logits, math.nan), logits)


@pytest.mark.parametrize("classes", [2, 3])
def test_one_record_moves_the_released_vector_by_at_most_the_sensitivity(classes):
    x, y = _split(classes, 120, 7, [1 / classes] * classes)
    x[0, 0], y[0] = 99.0, 1  # the server's target
    model = _NanOnTarget(_model(classes, 1))
    whole = _release_vector(classification_sums(model, x, y, classes, LOSS_BOUND))
    moves = []
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        without = classification_sums(model, x[keep], y[keep], classes, LOSS_BOUND)
        moves.append(np.linalg.norm(whole - _release_vector(without)))
    bound = release_sensitivity(classes)
    assert max(moves) <= bound + 1e-9
    assert moves[0] == pytest.approx(bound)  # the crafted record reaches the bound
    # a finite record predicted right moves four counts and its loss: below the bound
    assert max(moves[1:]) < bound and max(moves[1:]) > math.sqrt(4 if classes == 2 else 3)


def test_the_release_has_the_charged_noise_and_the_ledger_its_rdp():
    x, y = _split(2, 300, 3, [0.8, 0.2])
    exact = classification_sums(_model(2, 3), x, y, 2, LOSS_BOUND)
    z, generator = 3.0, torch.Generator().manual_seed(0)
    releases = [noisy_release(exact, z, generator) for _ in range(4000)]
    noise = np.array([_release_vector(r) for r in releases]) - _release_vector(exact)
    assert noise.shape[1] == 2 + 2 * 2 + 2 * SCORE_BINS
    sigma = z * math.sqrt(5)
    assert all(r.noise_std == pytest.approx(sigma) and r.count == 300 for r in releases)
    np.testing.assert_allclose(noise.std(axis=0), sigma, rtol=0.08)
    np.testing.assert_allclose(noise.mean(axis=0), 0.0, atol=4 * sigma / math.sqrt(4000))
    assert abs(np.corrcoef(noise[:, :6].T)[np.triu_indices(6, 1)]).max() < 0.1  # independent
    # The Gaussian mechanism of L2 sensitivity Delta (measured above: sqrt 5 for two classes)
    # and noise sigma has RDP alpha Delta^2 / (2 sigma^2) (Opacus' analysis at rate 1): the
    # charge the ledger records for one evaluation at multiplier z.
    independent = compute_rdp(q=1.0, noise_multiplier=sigma / math.sqrt(5), steps=1,
                              orders=list(DEFAULT_ORDERS))
    charged = PrivacyLedger().rdp([metric_release_cost(z, None)])
    np.testing.assert_allclose(charged, independent, rtol=1e-12)
    assert metric_release_cost(z, 4) == GaussianSteps(z, 1.0, 1, 4)


def test_the_reply_carries_the_sums_and_the_server_checks_them_whole(server_task_identity):
    x, y = _split(2, 200, 5, [0.9, 0.1])
    sums = classification_sums(_model(2, 5), x, y, 2)
    fields = evaluation_fields(sums)
    assert len(fields["score-histogram"]) == 2 * SCORE_BINS and fields["metrics-noise-std"] == 0
    back = evaluation_of(fields, 2)
    np.testing.assert_array_equal(back.score_histogram, sums.score_histogram)
    assert back.accuracy == pytest.approx(sums.accuracy)
    reply = Message(RecordDict({METRICS: MetricRecord({**fields, "epsilon-spent": 0.5,
                                                       "cluster": 0})}),
                    dst_node_id=3, message_type="evaluate")
    checked = evaluate_reply(reply, 2)
    assert checked.auroc == pytest.approx(auroc(sums.score_histogram, sums.class_count))
    assert checked.balanced_accuracy == pytest.approx(
        balanced_accuracy(sums.class_correct, sums.class_count))
    assert checked.epsilon_spent == 0.5
    bad = [({"class-count": [1.0]}, "'class-count' must be a list of 2"),
           ({"class-correct": [1.0, math.nan]}, "finite"),
           ({"score-histogram": [1.0] * 20}, "'score-histogram' must be a list of 40"),
           ({"metrics-noise-std": -1.0}, "deviation >= 0"),
           ({"num-examples": 0}, "positive integer"),
           ({"test-accuracy": math.inf}, "finite")]
    for change, words in bad:
        with pytest.raises(ValueError, match=words):
            evaluation_of({**fields, **change}, 2)
    with pytest.raises(ValueError, match="no 'class-count'"):
        evaluation_of({k: v for k, v in fields.items() if k != "class-count"}, 2)
    with pytest.raises(ValueError, match="'score-histogram' is for two classes"):
        evaluation_of({**fields, "class-correct": [0.0] * 3, "class-count": [0.0] * 3}, 3)
