"""The DLG attack (dpcfl_flwr/attacks): it reconstructs a real Fashion-MNIST record from its
noise-free gradient, it fails under large d-privacy and DP-SGD noise, the privatisers release
what they promise, and ``dpcfl attack dlg`` writes its files and refuses bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dpcfl_flwr.attacks.dlg import (
    attack_model,
    flatten,
    privatise_dprivacy,
    privatise_dpsgd,
    reconstruction_error,
    released_gradient,
)
from dpcfl_flwr.attacks.sweep import random_image_mse, run_sweep
from dpcfl_flwr.cli import app
from dpcfl_flwr.data import load_dataset, normalisation
from dpcfl_flwr.models import build_model

# Measured on record 0 (an ankle boot) of the training split, ReLU CNN of seed 0, 10 L-BFGS
# steps: 0.022 without noise, 0.18 at v = 10, 0.32 at z = 1; a random image scores 0.26.
RECONSTRUCTED = 0.05
FAILED = 0.15
ITERATIONS = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """L-BFGS on a small CNN is latency bound: a second thread only contends (and the CLI sets
    one thread for the whole process, which the fixture restores afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def record() -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = load_dataset("fmnist", None)
    return (torch.from_numpy(train.images[[0]]).float() / 255.0,
            torch.from_numpy(train.labels[[0]]))


def _attack(record, privatiser: str, noise: float):
    pixels, labels = record
    model = attack_model("cnn", 10, 1, "relu", seed=0)
    [row] = run_sweep(model, pixels, labels, normalisation("fmnist"), privatiser, [noise],
                      clip=1.0, iterations=ITERATIONS, seed=0, num_classes=10)
    return row


def test_dlg_reconstructs_a_record_from_its_noise_free_gradient(record):
    row = _attack(record, "none", 0.0)
    assert row.mse < RECONSTRUCTED
    assert row.mse < random_image_mse(record[0], 0) / 5
    assert row.label_guess == [int(record[1][0])]


@pytest.mark.parametrize(("privatiser", "noise"), [("dprivacy", 10.0), ("dpsgd", 1.0)])
def test_dlg_fails_under_large_noise(record, privatiser, noise):
    assert _attack(record, privatiser, noise).mse > FAILED


def test_dpsgd_privatiser_clips_each_record_then_adds_gaussian_noise():
    per_sample = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    rng = np.random.default_rng(0)
    # z = 0: the mean of the clipped rows, [0.6, 0.8] and [0.3, 0.4]
    assert torch.allclose(privatise_dpsgd(per_sample, 1.0, 0.0, rng), torch.tensor([0.45, 0.6]))
    noisy = privatise_dpsgd(torch.zeros(1, 200_000), 2.0, 0.5, rng)
    assert float(noisy.std()) == pytest.approx(1.0, rel=0.01)  # z C for a batch of one


def test_dprivacy_privatiser_noise_norm_is_v_times_the_gradient_norm():
    gradient = torch.ones(30_000)
    assert torch.equal(privatise_dprivacy(gradient, 0.0, np.random.default_rng(0)), gradient)
    noise = privatise_dprivacy(gradient, 2.0, np.random.default_rng(0)) - gradient
    # Gamma(n, v ||g|| / n) has mean v ||g|| and relative spread 1 / sqrt(n) < 0.6 %
    assert float(noise.norm()) == pytest.approx(2.0 * math.sqrt(30_000), rel=0.03)


def test_released_gradient_leaves_the_model_unchanged(record):
    model = build_model("cnn", seed=0)
    before = flatten([p.detach().clone() for p in model.parameters()])
    gradient = released_gradient(model, (record[0] - 0.13) / 0.31, record[1])
    assert flatten(gradient).shape == before.shape
    assert torch.equal(flatten([p.detach() for p in model.parameters()]), before)


def test_reconstruction_error_pairs_a_batch_in_any_order():
    images = torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    assert reconstruction_error(images, images[[2, 0, 1]]) == 0.0


def test_cli_writes_the_grid_and_the_table(tmp_path: Path):
    out = tmp_path / "dlg"
    result = CliRunner().invoke(app, [
        "attack", "dlg", "--out", str(out), "--privatiser", "dprivacy", "--noise", "0,10",
        "--iterations", "2", "--index", "5"])
    assert result.exit_code == 0, result.output
    assert (out / "dlg.png").stat().st_size > 0
    payload = json.loads((out / "dlg.json").read_text())
    assert [row["noise"] for row in payload["rows"]] == [0.0, 10.0]
    assert payload["setting"]["indices"] == [5]
    assert "| dprivacy | v = 10 |" in (out / "dlg.md").read_text()


def test_cli_attacks_a_saved_cluster_model(tmp_path: Path):
    path = tmp_path / "cluster-0.pt"
    torch.save(build_model("cnn", seed=3).state_dict(), path)
    result = CliRunner().invoke(app, [
        "attack", "dlg", "--out", str(tmp_path / "out"), "--model-file", str(path),
        "--privatiser", "dpsgd", "--noise", "0.1", "--iterations", "1"])
    assert result.exit_code == 0, result.output
    assert "state dict cluster-0.pt" in json.loads(
        (tmp_path / "out" / "dlg.json").read_text())["setting"]["model"]


@pytest.mark.parametrize(("arguments", "message"), [
    (["--privatiser", "laplace"], "expected one of none, dpsgd, dprivacy"),
    (["--noise", "0.1"], "--noise needs --privatiser dpsgd or dprivacy"),
    (["--privatiser", "dpsgd", "--noise", "a,b"], "comma-separated list of numbers"),
    (["--index", "60000"], "outside the fmnist train split"),
    (["--model", "resnet18", "--activation", "sigmoid"], "builds a fresh CNN"),
])
def test_cli_refuses_bad_input(tmp_path: Path, arguments: list[str], message: str):
    result = CliRunner().invoke(app, ["attack", "dlg", "--out", str(tmp_path), *arguments])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_refuses_a_file_that_is_no_model(tmp_path: Path):
    path = tmp_path / "notes.pt"
    path.write_text("not a model")
    result = CliRunner().invoke(app, ["attack", "dlg", "--out", str(tmp_path / "o"),
                                      "--model-file", str(path)])
    assert result.exit_code == 2
    assert "neither a silo model file nor a torch state dict" in result.output
