"""The table source (``data-source = "table"``): real CSV and Parquet files written with
pyarrow give the features the schema says (checked against values worked out by hand and
with numpy), the same tensors from either format, the split given by a column or drawn; a bad
table is one line naming the file and the column, never a record's value."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from dpcfl_flwr.config.settings import parse_node_config, parse_run_config
from dpcfl_flwr.data import DataError
from dpcfl_flwr.data.schema import Schema, parse_features
from dpcfl_flwr.data.sources import SPLITS, SourceRequest, draw_split
from dpcfl_flwr.data.table import load_table
from dpcfl_flwr.silo.silo import Silo, records_problem
from tests.test_malicious_server import Attacker, _node_config, _run_config, _update, silo_data
from tests.test_own_records import _arrays_node

REPO = Path(__file__).resolve().parents[1]
FEATURES = "age:number(54,9), bp:number(120,20), sex:category(f|m), smoker:category(no|yes)"


def _schema(missing: str = "refuse", **changes) -> Schema:
    features = parse_features(FEATURES)
    values = {"input_shape": (sum(f.width for f in features),), "num_classes": 2,
              "features": features, "missing": missing, **changes}
    return Schema(**values)


def _request(path: Path, schema: Schema | None = None, split_column: str = "",
             seed: int = 3, ignore: str = "id,note") -> SourceRequest:
    return SourceRequest(path, 5, seed, 0.25, 0.2, schema or _schema(),
                         {"split-column": split_column, "ignore-columns": ignore})


def _small() -> pa.Table:
    """Four records worked out by hand in the first test, an unused column, a split."""
    return pa.table({"id": ["a", "b", "c", "d"], "age": [54.0, 63.0, 45.0, 50.0],
                     "bp": [120, 140, 100, 130], "sex": ["f", "m", "f", "m"],
                     "smoker": ["no", "yes", "yes", "no"], "label": [0, 1, 1, 0],
                     "part": ["train", "train", "test", "train"]})


def _write(table: pa.Table, path: Path, **parquet) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        pa_csv.write_csv(table, path)
    else:
        pq.write_table(table, path, **parquet)
    return path


def _all(data) -> list[torch.Tensor]:
    return [getattr(data, f"{a}_{s}") for s in SPLITS for a in "xy"]


@pytest.mark.parametrize("name", ["t.csv", "t.parquet"])
def test_standardisation_and_indicators_match_the_hand_computation(tmp_path, name):
    table = _small().set_column(1, "age", pa.array([54.0, 63.0, 45.0, None]))
    data = load_table(_request(_write(table, tmp_path / name), _schema("fill"), "part"))
    # age (a - 54) / 9, bp (b - 120) / 20, sex f|m, smoker no|yes; record d misses its age:
    # filled with the schema mean 54, so 0 once standardised
    assert data.x_train.tolist() == [[0, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1],
                                     [0, 0.5, 0, 1, 1, 0]]
    assert data.x_test.tolist() == [[-1, -1, 1, 0, 0, 1]]
    assert data.y_train.tolist() == [0, 1, 0] and data.y_test.tolist() == [1]
    assert len(data.y_val) == 0 and data.x_train.dtype == torch.float32
    assert (data.client_id, data.cluster) == (5, -1)


def _random_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"label": rng.integers(0, 2, rows), "sex": rng.choice(["f", "m"], rows),
                     "age": rng.normal(50, 12, rows).round(1), "note": ["x"] * rows,
                     "smoker": rng.choice(["no", "yes"], rows),
                     "bp": rng.integers(90, 180, rows)})


def test_a_drawn_split_has_draw_splits_rows_and_numpys_numbers(tmp_path):
    table = _random_table(30)
    data = load_table(_request(_write(table, tmp_path / "t.parquet")))
    columns = table.to_pydict()
    expected = np.column_stack([
        (np.array(columns["age"]) - 54) / 9, (np.array(columns["bp"]) - 120) / 20,
        *[np.array(columns["sex"]) == v for v in ("f", "m")],
        *[np.array(columns["smoker"]) == v for v in ("no", "yes")]]).astype(np.float32)
    rows = draw_split(30, 3, 0.25, 0.2)
    for split in SPLITS:
        np.testing.assert_array_equal(getattr(data, f"x_{split}").numpy(), expected[rows[split]])
        np.testing.assert_array_equal(getattr(data, f"y_{split}").numpy(),
                                      np.array(columns["label"])[rows[split]])


def test_csv_parquet_row_groups_and_a_directory_give_identical_tensors(tmp_path):
    table = _random_table(40, seed=1)
    single = load_table(_request(_write(table, tmp_path / "t.csv")))
    others = [_write(table, tmp_path / "t.parquet"),
              _write(table, tmp_path / "groups.parquet", row_group_size=7),
              tmp_path / "directory"]
    _write(table.slice(0, 15), tmp_path / "directory" / "a.csv")
    _write(table.slice(15), tmp_path / "directory" / "b.pq", row_group_size=10)
    (tmp_path / "directory" / ".hidden").write_text("ignored")
    assert pq.ParquetFile(others[1]).num_row_groups == 6
    for path in others:
        assert all(torch.equal(a, b) for a, b in zip(_all(single), _all(load_table(
            _request(path))), strict=True)), path


def test_class_names_label_the_records(tmp_path):
    table = _small().set_column(5, "label", pa.array(["low", "high", " high ", "low"]))
    schema = _schema("fill", class_names=("low", "high"))
    data = load_table(_request(_write(table, tmp_path / "t.csv"), schema, "part"))
    assert data.y_train.tolist() == [0, 1, 0] and data.y_test.tolist() == [1]
    with pytest.raises(DataError, match=r"label column 'label' holds a label not one of the "
                                        r"schema's classes \(0..1\)"):
        load_table(_request(tmp_path / "t.csv", _schema("fill"), "part"))


def test_a_missing_category_is_all_zero_when_filled(tmp_path):
    table = _small().set_column(3, "sex", pa.array(["f", None, "", "m"]))
    data = load_table(_request(_write(table, tmp_path / "t.parquet"), _schema("fill"), "part"))
    assert data.x_train[:, 2:4].tolist() == [[1, 0], [0, 0], [0, 1]]
    assert data.x_test[:, 2:4].tolist() == [[0, 0]]


def _changed(column: str, values: list, name: str = "t.csv"):
    """A case: the small table with ``column`` replaced (or added)."""
    def make(directory: Path) -> Path:
        table = _small()
        index = table.schema.get_field_index(column)
        array = pa.array(values)
        table = (table.set_column(index, column, array) if index >= 0
                 else table.append_column(column, array))
        return _write(table, directory / name)
    return make


def _without(column: str, name: str = "t.csv"):
    return lambda d: _write(_small().drop_columns([column]), d / name)


def _raw(name: str, content: bytes):
    def make(directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
        return directory / name
    return make


@pytest.mark.parametrize(("make", "words", "secret"), [
    (lambda d: d / "absent.csv", "absent.csv: no such file or directory", None),
    (_raw("t.parquet", b"PAR1 not really"), "t.parquet: not readable as Parquet", None),
    (_raw("t.csv", b"age,bp,sex,smoker,label,part\n54,120,f,no,0,train\nsecret-row,1\n"),
     "t.csv: not readable as CSV", "secret-row"),
    (_raw("t.txt", b"age\n1\n"), "t.txt: not a table file", None),
    (_raw("t.csv", b"age,bp,sex,smoker,label,part\n"), "t.csv: the table holds no records",
     None),
    (_without("bp"), "t.csv: column 'bp' missing; 3 of 4 features", None),
    (_without("label", "t.parquet"), "t.parquet: label column 'label' missing", None),
    (_changed("label", [0, 1, 5, 0]),
     "t.csv: label column 'label' holds a label not one of the schema's classes (0..1)", None),
    (_changed("label", [0, None, 1, 0], "t.parquet"),
     "t.parquet: label column 'label' has missing labels", None),
    (_changed("age", [54.0, math.nan, 45.0, 50.0], "t.parquet"),
     "t.parquet: column 'age' has missing values (null, empty or NaN) and the schema's "
     "missing-values rule is refuse", None),
    (_changed("age", [54.0, 1.0, 45.0, None]), "t.csv: column 'age' has missing values", None),
    (_changed("age", ["54", "nan", "45", "50"]), "t.csv: column 'age' has missing values", None),
    (_changed("age", ["54", "NA", "45", "50"]), "t.csv: column 'age' holds text that is not a "
     "number", None),
    (_changed("sex", ["f", "m", "secret-x", "m"]),
     "t.csv: column 'sex' holds a value that is not among the schema's categories", "secret-x"),
    (_changed("bp", ["120", "high-secret", "100", "130"], "t.parquet"),
     "t.parquet: column 'bp' holds text that is not a number", "high-secret"),
    (_changed("bp", [120.0, math.inf, 100.0, 130.0], "t.parquet"),
     "t.parquet: column 'bp' holds an infinite number", None),
    (_changed("part", ["train", "train", "holdout", "train"]),
     "t.csv: split column 'part' holds a value other than train, val, test", "holdout"),
    (_changed("part", ["train", "train", "val", "train"]),
     "t.csv: the given split has no test records", None),
    (_changed("part", ["train", "test", "test", "test"]),
     "t.csv: 1 training records; a silo needs at least 2", None),
    (_changed("zip-secret", ["1", "2", "3", "4"]),
     "t.csv: column 'zip-secret' not in the schema (1 extra); the silo's ignore-columns "
     "lists the columns it leaves out", None),
])
def test_a_bad_table_is_one_line_naming_the_file_and_column(tmp_path, make, words, secret):
    path = make(tmp_path)
    with pytest.raises(DataError) as caught:
        load_table(_request(path, split_column="part"))
    message = str(caught.value)
    assert words in message and "\n" not in message and str(tmp_path) in message
    assert secret is None or secret not in message  # no record's value reaches the server


def test_a_schema_without_features_or_with_the_label_as_a_feature_is_refused(tmp_path):
    path = _write(_small(), tmp_path / "t.csv")
    with pytest.raises(DataError, match="needs the federation's schema to list the features"):
        load_table(_request(path, Schema((1, 28, 28), 2)))
    with pytest.raises(DataError, match="the label column 'sex' is also listed as a feature"):
        load_table(_request(path, _schema(label="sex")))


def _table_silo(tmp_path: Path, path: Path) -> tuple[dict, dict]:
    pinned = f'features = "{FEATURES}"\nnum-classes = 2\nmissing-values = "fill"\n'
    node = _arrays_node(tmp_path, path, pinned, **{"data-source": "table",
                                                   "split-column": "part",
                                                   "ignore-columns": "id"})
    run = _run_config(tmp_path, features=FEATURES, **{"num-classes": 2, "model": "mlp",
                                                      "missing-values": "fill"})
    return node, run


def test_a_table_silo_reads_its_records_through_the_silo(tmp_path):
    """The silo's own code path (node config, run config's schema, Silo.data and the check
    `dpcfl client` runs before it joins) gives the records the source gives."""
    path = _write(_small(), tmp_path / "site.csv")
    node, run = _table_silo(tmp_path, path)
    experiment = parse_run_config(run)
    data = Silo(parse_node_config(node), experiment, 11).data
    direct = load_table(_request(path, _schema("fill"), "part"))
    assert all(torch.equal(a, b) for a, b in zip(_all(data), _all(direct), strict=True))
    settings = parse_node_config(node).resolved(experiment, trust_run_config=False)
    assert records_problem(settings, experiment.data_schema) is None
    broken = _write(_small().drop_columns(["bp"]), tmp_path / "broken.csv")
    settings = parse_node_config(_table_silo(tmp_path, broken)[0]).resolved(
        experiment, trust_run_config=False)
    assert records_problem(settings, experiment.data_schema) == (
        f"the silo's records: {broken}: column 'bp' missing; 3 of 4 features")


def test_a_bad_table_is_refused_before_any_charge(tmp_path, server_task_identity, caplog):
    path = _write(_small().drop_columns(["smoker"]), tmp_path / "site.parquet")
    attacker = Attacker(tmp_path, *_table_silo(tmp_path, path))
    reply = attacker.train(1, cluster=-2)
    assert reply.has_error()
    assert "smoker" not in reply.error.reason and str(path) not in reply.error.reason
    assert f"{path}: column 'smoker' missing; 3 of 4 features" in caplog.text
    assert not attacker.ledger_path.exists() or not attacker.ledger().entries


def _data_check(tmp_path: Path, table: pa.Table) -> subprocess.CompletedProcess[str]:
    """``dpcfl data check`` on a table silo's file with its schema-file, run from this
    checkout (the operator's look at their records before joining)."""
    _write(table, tmp_path / "site.parquet")
    (tmp_path / "silo.toml").write_text(textwrap.dedent("""
        name = "site-3"
        [node]
        partition-id = 3
        data-source = "table"
        data-path = "site.parquet"
        split-column = "part"
        ignore-columns = "id"
        schema-file = "schema.toml"
    """))
    (tmp_path / "schema.toml").write_text(f'features = "{FEATURES}"\nnum-classes = 2\n')
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "data", "check",
                           "silo.toml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_dpcfl_data_check_reads_a_table_silo(tmp_path):
    fits = _data_check(tmp_path, _small())
    assert fits.returncode == 0, fits.stderr
    assert "3 / 0 / 1" in fits.stdout and "fits the schema" in fits.stdout
    missing = _data_check(tmp_path, _small().drop_columns(["age"]))
    assert missing.returncode == 2
    assert "site.parquet: column 'age' missing; 3 of 4 features" in missing.stdout + \
        missing.stderr


def test_a_benchmark_silo_as_a_table_trains_the_same_round(tmp_path, server_task_identity):
    """Fashion-MNIST records exported as a CSV of 784 pixel columns (the normalised values
    written exactly, a split column), read back with the schema laying the features out as
    1,28,28: the same records in the same order, so the same N_i, ledger and, with the same
    noise seed, the very same update as the benchmark silo's."""
    seeded = {"noise-seed": 7}
    benchmark = Attacker(tmp_path / "benchmark", _node_config(tmp_path / "benchmark", **seeded))
    data = silo_data(benchmark)
    columns: dict[str, list] = {f"p{i}": [] for i in range(784)}
    columns["label"], columns["part"] = [], []
    for split in SPLITS:
        x, y = getattr(data, f"x_{split}").numpy(), getattr(data, f"y_{split}").numpy()
        for i, values in enumerate(x.reshape(len(x), 784).T):
            columns[f"p{i}"] += values.astype(np.float64).tolist()  # exact float32 values
        columns["label"] += y.tolist()
        columns["part"] += [split] * len(y)
    path = _write(pa.table(columns), tmp_path / "fmnist.csv")
    features = "p{0..783}:number"  # the 784 pixel columns p0 .. p783
    run = _run_config(tmp_path, features=features, **{"input-shape": "1,28,28"})
    pinned = f'features = "{features}"\ninput-shape = "1,28,28"\n'
    table = Attacker(tmp_path / "own", _arrays_node(
        tmp_path / "own", path, pinned, **{"data-source": "table", "split-column": "part",
                                           **seeded}), run)
    mine = silo_data(table)
    assert all(torch.equal(a, b) for a, b in zip(_all(mine), _all(data), strict=True))
    replies = [a.train(1, cluster=-2) for a in (benchmark, table)]
    assert not any(r.has_error() for r in replies)
    np.testing.assert_array_equal(_update(replies[0]), _update(replies[1]))
    assert benchmark.ledger().entries == table.ledger().entries


@pytest.mark.parametrize(("column", "bad", "words"), [
    ("sex", "x", "column 'sex' holds a value that is not among the schema's categories"),
    ("age", None, "column 'age' has missing values"),
    ("label", 7, "label column 'label' holds a label not one of the schema's classes"),
    ("part", "holdout", "split column 'part' holds a value other than"),
])
def test_a_refusal_names_the_first_row_at_fault_across_row_groups(tmp_path, column, bad,
                                                                   words):
    """For the silo's operator (the refusal stays on the silo): row 8 of 10, counted from 1
    without the header, in the third row group of three rows each."""
    rows = {name: values * 3 for name, values in _small().to_pydict().items()}
    rows = {name: values[:10] for name, values in rows.items()}
    rows[column] = [*rows[column][:7], bad, *rows[column][8:]]
    path = _write(pa.table(rows), tmp_path / "t.parquet", row_group_size=3)
    with pytest.raises(DataError) as caught:
        load_table(_request(path, split_column="part"))
    assert words in str(caught.value) and str(caught.value).endswith("(row 8)")
