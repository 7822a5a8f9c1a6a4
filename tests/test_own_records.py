"""A silo trains on its own records (``data-source = "arrays"``): the same records as the
benchmark reader give the same N_i, z and update; a bad file or a record that does not fit the
federation's schema is one line, with nothing trained and nothing charged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.data import DataError
from dpcfl_flwr.data.arrays import load_arrays
from dpcfl_flwr.protocol import BAD_REQUEST, SILO_FAILED
from dpcfl_flwr.silo.silo import records_problem
from tests.test_malicious_server import (
    Attacker,
    _node_config,
    _refused,
    _run_config,
    _update,
    silo_data,
)


def _export(data, path: Path) -> Path:
    np.savez(path, **{f"{a}_{s}": getattr(data, f"{a}_{s}").numpy()
                      for a in "xy" for s in ("train", "val", "test")})
    return path


#: The federation's schema of the benchmark's records, as a silo pins it.
SCHEMA = 'input-shape = "1,28,28"\nnum-classes = 10\n'


def _arrays_node(tmp_path: Path, path: Path, schema: str = SCHEMA, **extra) -> dict:
    """A deployed silo reading ``path`` under its pinned ``schema`` (a schema file's text)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "schema.toml").write_text(schema)
    node = _node_config(tmp_path, **{"data-source": "arrays", "data-path": str(path),
                                     "schema-file": str(tmp_path / "schema.toml"), **extra})
    for key in ("clusters", "samples-per-client", "test-samples", "val-fraction"):
        node.pop(key)
    return node


def test_the_same_records_as_arrays_train_the_same_round(tmp_path, server_task_identity):
    """Records exported already normalised, read as stored (input-scaling = "none"): the
    very update the built-in reader's records give; read with the default per-record
    scaling, another one."""
    data = silo_data(Attacker(tmp_path / "benchmark"))  # a benchmark silo's records
    path = _export(data, tmp_path / "records.npz")
    seeded = {"noise-seed": 7}
    benchmark = Attacker(tmp_path / "benchmark", _node_config(tmp_path / "benchmark", **seeded))
    as_read = Attacker(tmp_path / "own", _arrays_node(
        tmp_path / "own", path, SCHEMA + 'input-scaling = "none"\n', **seeded),
        _run_config(tmp_path / "own", **{"input-scaling": "none"}))
    scaled = Attacker(tmp_path / "scaled", _arrays_node(tmp_path / "scaled", path, **seeded))
    replies = [a.train(1, cluster=-2) for a in (benchmark, as_read, scaled)]
    assert not any(r.has_error() for r in replies)
    np.testing.assert_array_equal(_update(replies[0]), _update(replies[1]))
    assert not np.array_equal(_update(replies[0]), _update(replies[2]))
    assert benchmark.ledger().entries == as_read.ledger().entries  # same N_i, so the same z


def test_a_drawn_split_is_the_silos_own_and_reproducible(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 100)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    first = load_arrays(tmp_path / "xy.npz", 3, seed=5, val_fraction=0.25, test_fraction=0.2)
    again = load_arrays(tmp_path / "xy.npz", 3, seed=5, val_fraction=0.25, test_fraction=0.2)
    other = load_arrays(tmp_path / "xy.npz", 3, seed=6, val_fraction=0.25, test_fraction=0.2)
    assert (len(first.y_train), len(first.y_val), len(first.y_test)) == (60, 20, 20)
    assert np.array_equal(first.x_train.numpy(), again.x_train.numpy())
    assert not np.array_equal(first.x_train.numpy(), other.x_train.numpy())
    rows = {r.tobytes() for r in np.concatenate([first.x_train.numpy(), first.x_val.numpy(),
                                                  first.x_test.numpy()])}
    assert len(rows) == 100  # every record in exactly one split


def test_a_directory_of_npy_files_is_memory_mapped(tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "x.npy", rng.normal(size=(40, 1, 28, 28)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 40))
    data = load_arrays(tmp_path, 0, seed=0, val_fraction=0.25, test_fraction=0.25)
    assert data.num_train + len(data.y_val) + len(data.y_test) == 40


@pytest.mark.parametrize(("make", "words"), [
    (lambda d: None, "no such file"),
    (lambda d: np.savez(d / "r.npz", a=np.zeros(3)), "expected arrays x and y"),
    (lambda d: np.savez(d / "r.npz", x=np.zeros((5, 1, 28, 28)), y=np.zeros(4, int)),
     "same length"),
    (lambda d: np.savez(d / "r.npz", x=np.full((6, 1, 28, 28), np.nan), y=np.zeros(6, int)),
     "NaN or infinite"),
    (lambda d: np.savez(d / "r.npz", x=np.zeros((6, 1, 28, 28)), y=np.zeros(6)),
     "must be integers"),
    (lambda d: np.savez(d / "r.npz", x_train=np.zeros((6, 1, 28, 28)), y_train=np.zeros(6, int)),
     "missing x_test, y_test"),
    (lambda d: np.save(d / "r.npz.npy", np.zeros((6, 1, 28, 28))) or (d / "r.npz.npy").rename(
        d / "r.npz"), "a single array"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, make, words):
    make(tmp_path)
    with pytest.raises(DataError, match=words) as caught:
        load_arrays(tmp_path / "r.npz", 0, seed=0, val_fraction=0.25, test_fraction=0.2)
    assert "\n" not in str(caught.value) and "r.npz" in str(caught.value)


@pytest.mark.parametrize(("records", "words"), [
    (lambda rng: (rng.normal(size=(60, 3, 32, 32)), rng.integers(0, 10, 60)),
     "shape (3, 32, 32), the federation's schema says (1, 28, 28)"),
    (lambda rng: (rng.normal(size=(60, 1, 28, 28)), rng.integers(0, 12, 60)),
     "labels outside the schema's 10 classes"),
])
def test_records_that_do_not_fit_the_schema_are_refused_before_any_charge(
        tmp_path, server_task_identity, caplog, records, words):
    x, y = records(np.random.default_rng(2))
    np.savez(tmp_path / "mine.npz", x=x.astype(np.float32), y=y)
    attacker = Attacker(tmp_path, _arrays_node(tmp_path, tmp_path / "mine.npz"))
    reply = attacker.train(1, cluster=-2)
    _refused(reply, SILO_FAILED, "the silo's records cannot be read under its schema")
    assert "mine.npz" not in reply.error.reason and "shape" not in reply.error.reason
    assert words in caplog.text and "mine.npz" in caplog.text  # the operator's log says why
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


def test_a_run_with_another_schema_is_refused_before_any_record_is_read(
        tmp_path, server_task_identity):
    attacker = Attacker(tmp_path, _arrays_node(tmp_path, tmp_path / "absent.npz"),
                        _run_config(tmp_path, **{"input-shape": "3,32,32", "model": "resnet18"}))
    reply = attacker.query()  # its records do not even exist: none is read
    _refused(reply, BAD_REQUEST, "schema key input-shape differs from this silo's pinned")
    assert not attacker.ledger_path.exists()


def test_dpcfl_client_checks_the_records_before_it_joins(tmp_path):
    node = parse_node_config(_arrays_node(tmp_path, tmp_path / "missing.npz"))
    settings = node.resolved(parse_run_config({}), trust_run_config=False)
    assert "missing.npz: no such file" in records_problem(settings)


def test_arrays_need_a_path():
    from dpcfl_flwr.config.validation import ConfigError

    node = parse_node_config({"partition-id": 0, "epsilon": 1.0, "delta": 1e-5,
                              "ledger-path": "l.json", "data-source": "arrays"})
    with pytest.raises(ConfigError, match="data-source = arrays needs data-path"):
        node.resolved(parse_run_config({}), trust_run_config=False)
