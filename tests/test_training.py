"""DP-SGD local training checked against plain autograd, the noise law, and memory bounds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dpcfl_flwr.dpsgd.per_sample import activation_floats, make_engine
from dpcfl_flwr.dpsgd.training import (
    DPSGDConfig,
    GaussianNoise,
    chunk_size,
    configure_threads,
    evaluate,
    train_dp,
)
from dpcfl_flwr.models import build_model
from dpcfl_flwr.models.spec import ModelSpec, build


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in update.values()])


def _manual_clipped_mean_gradient(model, x, y, clip: float) -> torch.Tensor:
    """Independent reference: one autograd pass per sample, clip, average."""
    total = None
    for i in range(x.shape[0]):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        g = g * min(1.0, clip / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total / x.shape[0]


@pytest.mark.parametrize("physical", [None, 3])
def test_full_batch_step_is_minus_lr_times_clipped_mean_gradient(physical):
    x, y = _data(10)
    start = build_model("cnn", seed=1)
    reference = _manual_clipped_mean_gradient(build_model("cnn", seed=1), x, y, clip=0.5)
    config = DPSGDConfig(1e-9, 0.5, 0.1, "full", physical_batch_size=physical)
    result = train_dp(start, x, y, config, round_number=1, seed=3)
    torch.testing.assert_close(_flat(result.update), -0.1 * reference, rtol=1e-4, atol=1e-7)
    assert result.steps == 1
    (entry,) = result.entries
    assert (entry.sample_rate, entry.steps, entry.round) == (1.0, 1, 1)


def test_full_batch_noise_has_lemma_4_1_variance():
    # Full batch, K = 1: Var(dTheta) per coordinate = lr^2 z^2 c^2 / N^2 (paper Lemma 4.1;
    # docs/algorithm.md#dp-sgd-step, A3).
    x, y = _data(40)
    lr, z, clip = 0.2, 2.0, 1.5
    updates = torch.stack([
        _flat(train_dp(build_model("cnn", seed=0), x, y, DPSGDConfig(z, clip, lr, "full"),
                       seed=s).update)
        for s in range(24)
    ])
    variance = float(updates.var(dim=0).mean())
    expected = (lr * z * clip / 40) ** 2
    assert variance == pytest.approx(expected, rel=0.05)


def test_one_draw_noises_parameters_of_every_shape_and_dtype():
    """The step's noise comes from one flat draw per dtype: each parameter still gets noise of
    its own shape and dtype, of standard deviation std, fresh at every step and independent
    across parameters (no two share numbers)."""
    params = [torch.nn.Parameter(torch.zeros(300, 20)), torch.nn.Parameter(
        torch.zeros(40, 50, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(7))]
    noise = GaussianNoise(params, torch.Generator().manual_seed(0))
    first = [torch.zeros_like(p) for p in params]
    noise.add_to(first, 2.0)
    second = [torch.zeros_like(p) for p in params]
    noise.add_to(second, 2.0)
    for a, b, p in zip(first, second, params, strict=True):
        assert a.shape == p.shape and a.dtype == p.dtype and not torch.equal(a, b)
    drawn = torch.cat([t.double().flatten() for t in first + second])
    assert float(drawn.std()) == pytest.approx(2.0, rel=0.02)
    assert abs(float(drawn.mean())) < 0.05
    assert torch.unique(drawn).numel() == drawn.numel()


def test_poisson_rounds_sample_at_rate_b_over_n_and_record_their_steps():
    n, b, epochs = 300, 32, 2
    x, y = _data(n)
    result = train_dp(build_model("cnn", seed=0), x, y, DPSGDConfig(1.0, 1.0, 0.01, b, epochs),
                      round_number=4, seed=0)
    steps = epochs * math.ceil(n / b)
    assert result.steps == steps
    (entry,) = result.entries
    assert (entry.sample_rate, entry.steps, entry.round) == (b / n, steps, 4)
    # Poisson: the number of records used is Binomial(n * steps, b / n).
    mean, std = steps * b, math.sqrt(steps * n * (b / n) * (1 - b / n))
    assert abs(result.sampled_examples - mean) < 5 * std


def test_same_seed_same_update_and_unseeded_runs_differ():
    x, y = _data(64)
    config = DPSGDConfig(1.0, 1.0, 0.05, 16)

    def run(seed):
        return _flat(train_dp(build_model("cnn", seed=0), x, y, config, seed=seed).update)

    torch.testing.assert_close(run(7), run(7))
    assert not torch.equal(run(None), run(None))


def test_dp_training_learns_a_separable_task():
    # Two classes told apart by the sign of the mean pixel: DP-SGD must still learn it.
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (600,), generator=g)
    x = torch.randn(600, 1, 28, 28, generator=g) * 0.5 + (y.float() * 2 - 1).view(-1, 1, 1, 1)
    model = build_model("cnn", seed=0)
    config = DPSGDConfig(0.8, 1.0, 0.5, 60)
    for _ in range(3):
        train_dp(model, x, y, config, seed=None)
    _, accuracy = evaluate(model, x, y)
    assert accuracy > 0.9


def test_evaluate_matches_a_direct_computation():
    x, y = _data(50)
    model = build_model("cnn", seed=2)
    loss, accuracy = evaluate(model, x, y, batch_size=7)
    with torch.no_grad():
        logits = model(x)
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert accuracy == pytest.approx(float((logits.argmax(1) == y).float().mean()))


def test_bad_configurations_are_refused():
    x, y = _data(10)
    with pytest.raises(ValueError, match="exceeds"):
        train_dp(build_model("cnn"), x, y, DPSGDConfig(1.0, 1.0, 0.1, 11))
    with pytest.raises(ValueError):
        DPSGDConfig(0.0, 1.0, 0.1, 8)
    with pytest.raises(ValueError):
        DPSGDConfig(1.0, 1.0, 0.1, "half")


def test_configure_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        configure_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# The peak is the kernel's high-water mark of the process' resident memory, reset after the
# warm-up (writing 5 to /proc/self/clear_refs): without the reset, the import's own peak,
# which varies with what the page cache holds, can hide the round's.
_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from dpcfl_flwr.models import build_model
    from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp
    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    torch.set_num_threads(1)
    n = int(sys.argv[1])
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    model = build_model("cnn", seed=0)
    physical = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    config = DPSGDConfig(1.0, 1.0, 0.01, "full", physical_batch_size=physical or None)
    train_dp(model, x[:64], y[:64], config, seed=0)  # warm up allocator and kernels
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")
    before = status("VmRSS")
    train_dp(model, x, y, config, seed=0)
    print(json.dumps({"growth_kib": status("VmHWM") - before}))
""")


def _peak_growth_kib(n: int, physical: int = 64) -> int:
    """Peak resident growth of a full-batch round on ``n`` records in chunks of ``physical``
    (0: the default chunk), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(physical)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])["growth_kib"]


def test_full_batch_round_memory_does_not_grow_with_n():
    # Gradient accumulation: the working set is one physical chunk, whatever N is.
    growth = {n: _peak_growth_kib(n) for n in (1_000, 8_000)}
    assert growth[8_000] - growth[1_000] < 16 * 1024, growth  # < 16 MiB apart
    per_sample_grads_if_materialised = 8_000 * 28_938 * 4 / 1024
    assert np.max(list(growth.values())) < per_sample_grads_if_materialised / 4


def test_the_default_chunk_counts_the_activations_of_a_record():
    """The paper's CNN: per record, the outputs of its layers (by hand from the architecture:
    conv 16x28x28, ReLU, pool 16x14x14, conv 32x14x14, ReLU, pool 32x7x7, linear 10) and
    what the layerwise engine holds. Counted, a full-batch round of 375 records (the quick
    example's) runs in chunks of ~32 MiB (7 of them), and a round of 1,000 records peaks far
    below one chunk of them all (~0.02 GB against ~0.38 GB here)."""
    model = build_model("cnn", seed=0)
    record = torch.randn(1, 1, 28, 28)
    by_hand = 2 * 16 * 28 * 28 + 16 * 14 * 14 + 2 * 32 * 14 * 14 + 32 * 7 * 7 + 10
    assert activation_floats(model, record) == by_hand
    engine = make_engine(model, "layerwise")
    chunk = chunk_size(model, None, engine.floats_per_record(record), by_hand)
    per_record = engine.floats_per_record(record) + 3 * by_hand
    assert chunk == (8 * 2**20) // per_record
    assert 32 <= chunk < 375 / 6
    mlp = build(ModelSpec("mlp", 2, (30,)), seed=0)
    row = torch.randn(1, 30)
    assert chunk_size(mlp, None, make_engine(mlp, "layerwise").floats_per_record(row),
                      activation_floats(mlp, row)) == 2048  # a small model keeps large chunks
    default, whole = _peak_growth_kib(1_000, 0), _peak_growth_kib(1_000, 1_000)
    assert default < 0.25 * whole, (default, whole)


def test_a_poisson_step_that_draws_no_record_is_noise_alone():
    """At rate 1/N a step draws no record with probability ~1/e; it must add noise only (a
    message at batch 1 once failed with 'groups=0' in the per-sample convolution)."""
    torch.manual_seed(0)
    model = build_model("cnn", seed=0)
    x, y = torch.randn(3, 1, 28, 28), torch.randint(0, 10, (3,))
    result = train_dp(model, x, y, DPSGDConfig(1.0, 1.0, 0.01, 1, epochs=8), seed=1)
    assert result.steps == 24  # P(no step draws nothing) = (1 - (2/3)^3)^24 = 2e-4
    assert all(torch.isfinite(u).all() for u in result.update.values())
