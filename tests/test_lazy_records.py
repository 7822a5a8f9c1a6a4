"""Records read when used (dpcfl_flwr/data/records.py): a silo whose .npy records stay in
their files trains and evaluates exactly as with the same records in memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpcfl_flwr.data.arrays import load_arrays
from dpcfl_flwr.data.records import LazyRecords, in_memory
from dpcfl_flwr.dpsgd.training import DPSGDConfig, evaluation_sums, train_dp, train_sgd
from dpcfl_flwr.models import build_model


@pytest.fixture
def npy_records(tmp_path):
    rng = np.random.default_rng(3)
    np.save(tmp_path / "x.npy", rng.normal(size=(120, 1, 28, 28)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 120))
    return tmp_path


def test_npy_records_stay_in_their_files_and_read_what_is_asked(npy_records):
    data = load_arrays(npy_records, 0, seed=0, val_fraction=0.25, test_fraction=0.2)
    assert isinstance(data.x_train, LazyRecords)
    x = np.load(npy_records / "x.npy")
    rows = data.x_train.rows
    assert data.x_train.shape == (len(rows), 1, 28, 28) and len(data.x_train) == len(rows)
    assert torch.equal(data.x_train[:], torch.from_numpy(x[rows]))
    mask = torch.arange(len(rows)) % 3 == 0
    assert torch.equal(data.x_train[mask], torch.from_numpy(x[rows[mask.numpy()]]))
    picks = torch.tensor([5, 0, 9])
    assert torch.equal(data.x_train[picks], torch.from_numpy(x[rows[[5, 0, 9]]]))
    assert data.x_train[torch.zeros(len(rows), dtype=torch.bool)].shape == (0, 1, 28, 28)


@pytest.mark.parametrize("batch", [16, "full"])
def test_dp_sgd_on_records_read_when_used_equals_in_memory(npy_records, batch):
    """The same seeded round (Poisson steps, or the full batch chunk by chunk) gives the same
    update and the same cost whether records are read when used or held in memory."""
    data = load_arrays(npy_records, 0, seed=0, val_fraction=0.25, test_fraction=0.2)
    config = DPSGDConfig(noise_multiplier=1.1, clip_norm=1.0, learning_rate=0.05,
                         batch_size=batch, physical_batch_size=7)
    results = []
    for x in (data.x_train, in_memory(data.x_train)):
        model = build_model("cnn", seed=0)
        results.append(train_dp(model, x, data.y_train, config, round_number=2, seed=11))
    lazy, eager = results
    assert lazy.entries == eager.entries
    assert lazy.sampled_examples == eager.sampled_examples > 0
    for name in eager.update:
        assert torch.allclose(lazy.update[name], eager.update[name], atol=1e-6), name
    model = build_model("cnn", seed=0)
    assert evaluation_sums(model, data.x_test, data.y_test, batch_size=5) == pytest.approx(
        evaluation_sums(model, in_memory(data.x_test), data.y_test, batch_size=5))
    sgd = [train_sgd(build_model("cnn", seed=0), x, data.y_train, 0.05, 8, seed=4)
           for x in (data.x_train, in_memory(data.x_train))]
    assert all(torch.allclose(sgd[0][k], sgd[1][k], atol=1e-6) for k in sgd[1])


def test_file_rows_read_exactly_the_rows_asked_in_any_order(tmp_path):
    """Positioned reads of a .npy file: unsorted rows, repeats and runs of consecutive rows
    give what indexing the array gives, in its own dtype; a row outside the file is refused."""
    from dpcfl_flwr.data.records import FileRows

    x = np.random.default_rng(0).normal(size=(50, 2, 3))  # float64 on disk
    np.save(tmp_path / "x.npy", x)
    rows = FileRows.of_npy(np.load(tmp_path / "x.npy", mmap_mode="r"))
    for picks in ([7, 3, 3, 4, 5, 0], list(range(50)), [49], [], [10, 9, 8, 30, 31, 32, 1]):
        got = rows(np.array(picks, dtype=np.int64))
        assert got.dtype == np.float64 and np.array_equal(got, x[picks])
    with pytest.raises(IndexError, match="rows outside 0..49"):
        rows(np.array([50]))
