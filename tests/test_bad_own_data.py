"""Bad records, as a silo's operator meets them: each one stops a real ``dpcfl client`` before
it joins (exit 2), with one line naming the file and the problem, and nothing charged (no
ledger written). The silo file names its records and the federation's schema-file, as
docs/own-data.md says."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from PIL import Image

from tests.test_data_sources import PLUGIN, _install_plugin

DPCFL = str(Path(sys.executable).with_name("dpcfl"))
TABLE_SCHEMA = 'features = "age:number(50,10), sex:category(f|m)"\nnum-classes = 2\n'
IMAGE_SCHEMA = 'input-shape = "1,8,8"\nnum-classes = 2\n'


def _table(directory: Path, **columns: list) -> Path:
    values = {"age": [50.0, 61.0, 38.0, 45.0, 70.0], "sex": ["f", "m", "m", "f", "f"],
              "label": [0, 1, 1, 0, 1], **columns}
    pa_csv.write_csv(pa.table({k: v for k, v in values.items() if v is not None}),
                     directory / "site.csv")
    return directory / "site.csv"


def _images(directory: Path, per_class: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for name, count in per_class.items():
        (directory / "images" / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(
                directory / "images" / name / f"{i}.png")
    return directory / "images"


def _missing_file(d: Path):
    return "table", d / "absent.csv", TABLE_SCHEMA, "absent.csv: no such file or directory"


def _unreadable(d: Path):
    (d / "site.csv").mkdir()  # a directory where the file should be, holding no table
    return "table", d / "site.csv", TABLE_SCHEMA, "no table files"


def _undecodable_image(d: Path):
    root = _images(d, {"0": 3, "1": 3})
    (root / "1" / "2.png").write_bytes(b"\x89PNG broken")
    return "image-folder", root, IMAGE_SCHEMA, "2.png: does not decode as an image"


def _missing_column(d: Path):
    return ("table", _table(d, sex=None), TABLE_SCHEMA,
            "site.csv: column 'sex' missing; 1 of 2 features")


def _extra_column(d: Path):
    return ("table", _table(d, postcode=["a"] * 5), TABLE_SCHEMA,
            "site.csv: column 'postcode' not in the schema")


def _label_outside(d: Path):
    return ("table", _table(d, label=[0, 1, 2, 0, 1]), TABLE_SCHEMA,
            "label column 'label' holds a label not one of the schema's classes (0..1)")


def _nan_feature(d: Path):
    return ("table", _table(d, age=[50.0, None, 38.0, 45.0, 70.0]), TABLE_SCHEMA,
            "column 'age' has missing values (null, empty or NaN) and the schema's "
            "missing-values rule is refuse")


def _empty_class(d: Path):
    root = _images(d, {"0": 3, "1": 3})
    (root / "1b").mkdir()
    return ("image-folder", root, 'input-shape = "1,8,8"\nnum-classes = 3\n'
            'class-names = "0,1,1b"\n', "1b: empty class folder")


def _too_few_for_a_batch(d: Path):
    return ("table", _table(d), TABLE_SCHEMA + "# batch below\n",
            "the silo's batch-size 64 exceeds its")


def _plugin_not_installed(d: Path):
    return "no-such-source", d / "site.csv", TABLE_SCHEMA, "data-source"


def _plugin_raises(d: Path):
    _install_plugin(d / "plugins", PLUGIN)
    (d / "raise").write_text("")
    return ("ones", d / "raise", IMAGE_SCHEMA,
            "data-source 'ones' failed on")


CASES = [_missing_file, _unreadable, _undecodable_image, _missing_column, _extra_column,
         _label_outside, _nan_feature, _empty_class, _too_few_for_a_batch,
         _plugin_not_installed, _plugin_raises]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.lstrip("_") for c in CASES])
def test_bad_records_stop_dpcfl_client_with_one_line_and_nothing_charged(tmp_path, case):
    (tmp_path / "plugins").mkdir()
    source, path, schema, words = case(tmp_path)
    (tmp_path / "schema.toml").write_text(schema)
    batch = "batch-size = 64\n" if "batch below" in schema else ""
    (tmp_path / "silo.toml").write_text(textwrap.dedent(f"""
        name = "site-a"
        insecure = true
        [node]
        partition-id = 0
        epsilon = 1.0
        delta = 1e-5
        ledger-path = "ledger.json"
        data-source = "{source}"
        data-path = "{path}"
        schema-file = "schema.toml"
        test-fraction = 0.4
    """) + batch)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "300"}
    result = subprocess.run([DPCFL, "client", "silo.toml", "--dry-run"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env,
                            stdin=subprocess.DEVNULL)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert not (tmp_path / "ledger.json").exists()
