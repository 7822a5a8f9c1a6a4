"""examples/rand_hie.py on the real file the statsmodels wheel ships: one CSV per site whose
label is the self-rating, no person on both sides of a split, and tables that a silo reads
under the exported schema and that ``dpcfl data check`` passes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpcfl_flwr.config.config_file import load_schema
from dpcfl_flwr.config.settings import parse_run_config
from dpcfl_flwr.data.sources import SourceRequest
from dpcfl_flwr.data.table import load_table
from dpcfl_flwr.runs.compare import load_grid_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(REPO))
    try:
        from bench.common import script_module
    finally:
        sys.path.remove(str(REPO))
    return script_module(REPO / "examples" / "rand_hie.py")


@pytest.fixture(scope="module")
def exported(example, tmp_path_factory):
    out = tmp_path_factory.mktemp("rand-hie")
    return out, example.export(out)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_every_person_year_lands_at_its_site_with_its_self_rating(example, exported):
    out, paths = exported
    source = _rows(example.data_file())
    assert [p.name for p in paths] == [f"site-{s}.csv" for s in (1, 2, 3, 4, 5, 6)]
    split_of: dict[str, set[str]] = {}
    for site, path in zip((1, 2, 3, 4, 5, 6), paths, strict=True):
        rows = _rows(path)
        originals = [r for r in source if int(float(r["site"])) == site]
        assert len(rows) == len(originals) > 2000
        assert list(rows[0]) == [n for n, _, _ in example.FEATURES] + [example.LABEL, "split"]
        for row, original in zip(rows, originals, strict=True):
            rated = [float(original[c]) for c in ("hlthg", "hlthf", "hlthp")]
            assert int(row[example.LABEL]) == (sum(rated) == 0)
            assert row["mhi"] == original["mhi"]
            split_of.setdefault(original["zper"], set()).add(row["split"])
    # the split is drawn by person: no person is in both training and test
    assert all(len(splits) == 1 for splits in split_of.values())
    tested = sum(splits == {"test"} for splits in split_of.values()) / len(split_of)
    assert tested == pytest.approx(example.TEST_FRACTION, abs=0.01)


def test_the_tables_are_read_under_the_exported_schema(example, exported):
    out, paths = exported
    schema = load_schema(out / "schema.toml")
    share = []
    for partition, path in enumerate(paths):
        data = load_table(SourceRequest(path, partition, 0, 0.0, 0.2, schema,
                                        {"split-column": "split"}))
        assert data.x_train.shape[1:] == (len(example.FEATURES),)
        assert len(data.y_test) > 300 and set(data.y_train.tolist()) == {0, 1}
        share.append(float(data.y_train.float().mean()))
    # sites 5 and 6 hold fewer people in excellent health than sites 1-4 (the two groups)
    assert max(share[4:]) < 0.5 < min(share[:4])
    base, _ = load_grid_config(out / "run.toml")
    config = parse_run_config({**base, "method": "rdpcfl"})
    assert config.data_schema == schema


def test_dpcfl_data_check_passes_a_site(exported):
    out, paths = exported
    (out / "silo.toml").write_text(textwrap.dedent(f"""
        name = "site-5"
        [node]
        partition-id = 4
        data-source = "table"
        data-path = "{paths[4]}"
        split-column = "split"
        schema-file = "schema.toml"
    """))
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    checked = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "data", "check",
                              "silo.toml"], cwd=out, capture_output=True, text=True,
                             timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "fits the schema" in checked.stdout and "yes" in checked.stdout
