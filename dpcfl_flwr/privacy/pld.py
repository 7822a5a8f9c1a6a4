"""Privacy-loss-distribution (PLD) accounting, through Google's ``dp-accounting``.

docs/privacy.md#pld-accounting. A PLD is the distribution of the privacy loss
ln(P(o) / Q(o)) of a mechanism on two neighbouring datasets; composing mechanisms convolves
their PLDs, and the delta at any epsilon is read off the composed distribution exactly
(Koskela, Jälkö & Honkela 2020; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022,
"Connect the Dots"). It does not pass through Rényi divergences, whose conversion to (eps,
delta) is what makes RDP loose (P5, P6).

What each ledger mechanism becomes here:

- ``steps`` sampled-Gaussian steps at rate q < 1 and multiplier z: the PLD of the
  Poisson-subsampled Gaussian under add/remove adjacency (the adjacency of our RDP bound,
  docs/privacy.md#adjacency), composed ``steps`` times;
- Gaussian steps at rate 1 (R-DPCFL's full-batch round, private evaluations): the plain
  Gaussian mechanism. n of them at multipliers z_i compose to *exactly* one Gaussian of
  multiplier (sum_i n_i / z_i^2)^(-1/2), so they enter as one mechanism, without
  discretisation error from repeated convolution;
- an exponential-mechanism selection at epsilon_select: the worst-case PLD of an
  epsilon-DP mechanism (dp-accounting's ``from_privacy_parameters`` at delta = 0, the
  randomized-response pair, loss +-epsilon). Every epsilon-DP mechanism, on either side of
  add/remove, is a post-processing of that pair (Kairouz, Oh & Viswanath 2015), so composing
  it in the selection's place can only raise the bound;
- d-privacy releases are not (eps, delta)-DP and are left out, as in the RDP path.

Why the figure is an upper bound. Every PLD here is built with ``pessimistic_estimate=True``:
privacy losses are rounded *up* onto a grid of ``VALUE_DISCRETIZATION`` nats and any mass cut
from the tails (noise below e^-50, convolution tails below 1e-15) is moved to an infinite
loss, which counts fully towards delta. A pessimistic PLD dominates the true one, domination
survives composition, and the epsilon read from a dominating PLD is at least the true one.
The grid only decides how loose: at 1e-4 nats (dp-accounting's default) a schedule costs
under two seconds at our sizes, and a ten times coarser grid (:data:`SEARCH_DISCRETIZATION`,
about eight times cheaper) moved the quick example's epsilon by 3e-5 of it and the paper
scale's by 0.2% (docs/privacy.md#pld-accounting). Calibration searches on the coarse grid and
checks its answer on the fine one, which alone measures a spend.

The pure-DP bound for selections is looser than the bounded-range zCDP bound RDP uses
(eps^2 / 8 against a worst case near eps^2 / 2); with many selections at a large
epsilon_select it can lose more there than PLD saves on DP-SGD. Both figures bound the same
history at the same delta, so the ``pld`` accountant reports the smaller
(:class:`~.accountants.PldAccountant`): never above the RDP figure, and as sound as either.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.common import DifferentialPrivacyParameters
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution as PLD
from scipy import fft

from .history import GaussianRun, SelectionRun
from .pld_store import remembered

#: Width (nats) of the grid privacy losses are rounded up to (see the module docstring).
VALUE_DISCRETIZATION = 1e-4

#: The coarser grid a calibration searches z on before checking its answer on
#: :data:`VALUE_DISCRETIZATION`'s (an evaluation ~8x cheaper, epsilon at most ~0.2% looser).
SEARCH_DISCRETIZATION = 1e-3

#: The most sampled steps plus selections a history may compose by PLD: five times the
#: paper's 50 000 steps. A composition's cost grows with its count (0.1-1 s here, 35 s at 10^7
#: steps), and a server chooses the schedule a silo plans for, so beyond this the ``pld``
#: accountant reports the RDP figure of the history, also a proven bound
#: (docs/privacy.md#pld-accounting).
MAX_COMPOSED = 250_000

#: A history whose RDP figure exceeds this is measured by that figure: no budget comes near
#: it, and the PLD of a nearly noiseless mechanism is long (a Gaussian's losses spread over
#: ~1/z nats on a 1e-4 grid), so checking a request that asks for one must stay cheap.
MAX_EPSILON = 50.0

@functools.lru_cache(maxsize=8)
def _sampled_step(noise_multiplier: float, sample_rate: float, grid: float) -> PLD:
    return pld_lib.from_gaussian_mechanism(
        noise_multiplier, sampling_prob=sample_rate, pessimistic_estimate=True,
        value_discretization_interval=grid)


@functools.lru_cache(maxsize=1)
def _sampled_steps(noise_multiplier: float, sample_rate: float, steps: int, grid: float
                   ) -> PLD:
    """The composed PLD of a repeated step, remembered: a silo's ledger asks for the same
    history twice per message (the check before a round, the spend it reports). Only the
    last two: a composition holds 15-40 MB (the quick example's 16-360 steps), and eight of
    them were ~0.2 GB of a deployed silo's memory (its histories grow every round)."""
    return _sampled_step(noise_multiplier, sample_rate, grid).self_compose(steps)


@functools.lru_cache(maxsize=8)
def _gaussian(noise_multiplier: float, grid: float) -> PLD:
    return pld_lib.from_gaussian_mechanism(
        noise_multiplier, pessimistic_estimate=True, value_discretization_interval=grid)


@functools.lru_cache(maxsize=8)
def _pure_dp(epsilon: float, count: int, grid: float) -> PLD:
    single = pld_lib.from_privacy_parameters(
        DifferentialPrivacyParameters(epsilon, 0.0), value_discretization_interval=grid)
    return single.self_compose(count)


def _whole(steps: float) -> int:
    """PLDs compose whole mechanisms: a fractional planning count (``exact=False``) is
    rounded up, which only adds privacy loss."""
    return math.ceil(steps - 1e-9)


#: A history in canonical form: ((z, q, steps) of the sampled runs, sorted), the precision
#: sum_i n_i / z_i^2 of the full-batch steps, ((epsilon_select, count), sorted). Equal
#: histories, however they were listed, have equal keys.
HistoryKey = tuple[tuple[tuple[float, float, int], ...], float, tuple[tuple[float, int], ...]]


def history_key(gaussian: Iterable[GaussianRun], selections: Iterable[SelectionRun] = ()
                ) -> HistoryKey:
    """The canonical form of a history (validated)."""
    # Counts are summed as integers and parts kept in a fixed order, so the same mechanisms
    # give the same figure bit for bit whether a calibration lists them as a schedule or a
    # ledger as rounds (calibration.py keeps a 1e-9 margin for nothing else).
    full_batch: dict[float, int] = {}
    sampled: dict[tuple[float, float], int] = {}
    for z, q, steps in gaussian:
        if not (z > 0 and 0 < q <= 1 and steps >= 0):
            raise ValueError(f"invalid Gaussian mechanism (z={z}, q={q}, steps={steps})")
        if q == 1.0:
            full_batch[z] = full_batch.get(z, 0) + _whole(steps)
        else:
            sampled[(z, q)] = sampled.get((z, q), 0) + _whole(steps)
    counts: dict[float, int] = {}
    for epsilon, count in selections:
        if not epsilon > 0:
            raise ValueError(f"a selection needs epsilon > 0, got {epsilon}")
        counts[epsilon] = counts.get(epsilon, 0) + _whole(count)
    return (tuple((z, q, n) for (z, q), n in sorted(sampled.items()) if n),
            sum(n / z**2 for z, n in sorted(full_batch.items())),
            tuple((e, n) for e, n in sorted(counts.items()) if n))


def composable(gaussian: Iterable[GaussianRun], selections: Iterable[SelectionRun] = ()
               ) -> bool:
    """Whether the history is within :data:`MAX_COMPOSED` (full-batch steps enter as one
    Gaussian, whatever their number)."""
    sampled, _, counts = history_key(gaussian, selections)
    return sum(n for _, _, n in sampled) + sum(n for _, n in counts) <= MAX_COMPOSED


def history_pld(gaussian: Iterable[GaussianRun], selections: Iterable[SelectionRun] = (),
                grid: float = VALUE_DISCRETIZATION) -> PLD | None:
    """The composed PLD of a history on a ``grid`` of that many nats (None when it holds no
    mechanism)."""
    return _compose(history_key(gaussian, selections), grid)


def _compose(key: HistoryKey, grid: float) -> PLD | None:
    sampled, precision, counts = key
    parts = [_sampled_steps(z, q, n, grid) for z, q, n in sampled]
    if precision > 0:
        parts.append(_gaussian(1 / math.sqrt(precision), grid))
    parts += [_pure_dp(epsilon, n, grid) for epsilon, n in counts]
    if not parts:
        return None
    composed = functools.reduce(lambda a, b: a.compose(b), parts)
    _release_fft_plans()
    return composed


#: Transform lengths that push a composition's plans out of scipy's FFT plan cache (more than
#: the cache holds; each plan of these lengths is a few hundred bytes).
_SMALL_LENGTHS = range(2, 40)


def _release_fft_plans() -> None:
    """Let go of the FFT plans a composition left behind.

    dp-accounting convolves PLDs with scipy's FFT, which keeps the plans (twiddle factors) of
    the last lengths it transformed, in a cache per transform kind that nothing can clear. A
    composition's length follows its history, which grows each round, so a silo's process
    collected a new plan of 10-17 MB (lengths of 0.4-0.7 million, 1e-4-nat grid) per
    composition until the cache was full: ~66 MB of four compositions, measured, out of the
    process' heap. Transforming a few dozen tiny lengths of each kind the convolutions use
    replaces them (~1 ms); the next composition makes its own plan anyway, since its length
    is new."""
    for n in _SMALL_LENGTHS:
        real = np.ones(n)
        fft.ifft(fft.fft(real))
        fft.irfft(fft.rfft(real), n)


def pld_epsilon(gaussian: Iterable[GaussianRun], selections: Iterable[SelectionRun],
                delta: float, grid: float = VALUE_DISCRETIZATION) -> float:
    """Epsilon at ``delta`` of a history by PLD alone (0 for an empty history), its losses
    rounded up to a ``grid`` of that many nats: a spend is measured on
    :data:`VALUE_DISCRETIZATION`'s, a calibration's search may use a coarser one."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return _epsilon(history_key(gaussian, selections), delta, grid)


@functools.lru_cache(maxsize=1024)
def _epsilon(key: HistoryKey, delta: float, grid: float) -> float:
    """Remembered by exact history: in a simulation the silos of one process share their
    schedules, so each calibration's ~20 trial z and each round's check are computed once
    per process, not once per silo (a composition and its epsilon take 0.1-0.8 s); and, where
    the operator keeps a store (:mod:`.pld_store`), once per machine."""
    return remembered(key, delta, grid, lambda: _composed_epsilon(key, delta, grid))


def _composed_epsilon(key: HistoryKey, delta: float, grid: float) -> float:
    composed = _compose(key, grid)
    return 0.0 if composed is None else float(composed.get_epsilon_for_delta(delta))
