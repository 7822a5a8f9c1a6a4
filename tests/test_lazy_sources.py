"""Image folders and Parquet tables larger than a silo's ``records-memory`` are read when used
(docs/own-data.md#data-larger-than-memory): the same tensors as in memory, the same seeded
DP-SGD round, a cache that stays within its bound, and the same refusals at start-up."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torch import nn

from dpcfl_flwr.data import DataError
from dpcfl_flwr.data.image_folder import ImageRows, load_image_folder
from dpcfl_flwr.data.partition import ClientData
from dpcfl_flwr.data.records import FileRows, LazyRecords, in_memory
from dpcfl_flwr.data.schema import Schema, parse_features
from dpcfl_flwr.data.sources import SPLITS, SourceRequest
from dpcfl_flwr.data.table import load_table
from dpcfl_flwr.dpsgd.training import DPSGDConfig, evaluation_sums, train_dp

#: RGB images of 3 x 64 x 64: 36 of them are 1.7 MiB as float32 records (0.4 MiB of pixels).
IMAGES = Schema((3, 64, 64), 3, image_mean=(0.5, 0.4, 0.3), image_std=(0.2, 0.25, 0.3))
FEATURES = ("age:number(54,9), bp:number(120,20), sex:category(f|m), smoker:category(no|yes), "
            + ", ".join(f"v{i}:number(0,2)" for i in range(40)))
TABLE = Schema((46,), 2, class_names=("well", "ill"), features=parse_features(FEATURES),
               missing="fill")
#: Rows of the test table: 46 floats a record, 1.4 MiB of records (more than 1 MiB).
TABLE_ROWS = 8_000


def _request(path: Path, schema: Schema, memory_mib: int, **options: str) -> SourceRequest:
    return SourceRequest(path, 1, 7, 0.25, 0.2, schema,
                         {"records-memory": memory_mib, "ignore-columns": "id,part",
                          **options})


def _lazy_and_eager(load, path: Path, schema: Schema, lazy_mib: int, **options: str
                    ) -> tuple[ClientData, ClientData]:
    lazy = load(_request(path, schema, lazy_mib, **options))
    eager = load(_request(path, schema, 1024, **options))
    assert isinstance(lazy.x_train, LazyRecords) and isinstance(eager.x_train, torch.Tensor)
    return lazy, eager


def _assert_same_records(lazy: ClientData, eager: ClientData) -> None:
    for split in SPLITS:
        x_lazy, x_eager = getattr(lazy, f"x_{split}"), getattr(eager, f"x_{split}")
        assert x_lazy.shape == x_eager.shape
        assert torch.equal(in_memory(x_lazy), x_eager), split
        assert torch.equal(getattr(lazy, f"y_{split}"), getattr(eager, f"y_{split}")), split
    assert lazy.num_train == eager.num_train


def _images(root: Path, per_class: int = 12, seed: int = 0) -> None:
    """PNG files of three classes, RGB, RGBA and grayscale, most of another size than the
    schema's (so records are resized), under ``root/<label>/``."""
    rng = np.random.default_rng(seed)
    for label in range(3):
        (root / str(label)).mkdir(parents=True)
        for index in range(per_class):
            size = (64, 64) if index % 3 == 0 else (50 + index, 70)
            channels = (3, 4, 1)[index % 3]
            pixels = rng.integers(0, 256, (*size, channels), dtype=np.uint8)
            Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels).save(
                root / str(label) / f"{index:03d}.png")


def test_an_image_folder_read_when_used_gives_the_records_in_memory(tmp_path):
    _images(tmp_path)
    lazy, eager = _lazy_and_eager(load_image_folder, tmp_path, IMAGES, lazy_mib=1)
    _assert_same_records(lazy, eager)
    picks = torch.tensor([4, 0, 4, 9])  # unsorted, repeated
    assert torch.equal(lazy.x_train[picks], eager.x_train[picks])


def test_a_parquet_table_read_by_row_group_gives_the_records_in_memory(tmp_path):
    path = _table(tmp_path / "t.parquet", row_group_size=620)
    assert pq.ParquetFile(path).num_row_groups == 13
    lazy, eager = _lazy_and_eager(load_table, path, TABLE, lazy_mib=1)
    _assert_same_records(lazy, eager)
    given = _lazy_and_eager(load_table, path, TABLE, 1, **{"split-column": "part"})
    _assert_same_records(*given)
    assert len(given[0].y_val) == 0 < len(given[0].y_test)
    picks = torch.tensor([2_000, 3, 3, 4_799, 0])
    assert torch.equal(lazy.x_train[picks], eager.x_train[picks])


def test_a_directory_of_parquet_files_is_one_table_read_when_used(tmp_path):
    table = pq.read_table(_table(tmp_path / "whole.parquet", row_group_size=2_000))
    (tmp_path / "whole.parquet").unlink()
    parts = tmp_path / "parts"
    parts.mkdir()
    pq.write_table(table.slice(0, 3_400), parts / "a.parquet", row_group_size=1_000)
    pq.write_table(table.slice(3_400), parts / "b.parquet", row_group_size=700)
    _assert_same_records(*_lazy_and_eager(load_table, parts, TABLE, lazy_mib=1))


def _table(path: Path, row_group_size: int, rows: int = TABLE_ROWS) -> Path:
    """A table of ``rows`` records with missing values (filled by the schema's rule), an
    ignored column and a split column, written as Parquet row groups."""
    rng = np.random.default_rng(1)
    age = rng.normal(54, 9, rows)
    bp = rng.integers(90, 180, rows).astype(float)
    age[rng.random(rows) < 0.01] = np.nan
    sex = np.where(rng.random(rows) < 0.5, "f", "m").astype(object)
    sex[rng.random(rows) < 0.01] = None
    table = pa.table({
        "age": age, "bp": pa.array(bp, mask=rng.random(rows) < 0.01), "sex": sex,
        "smoker": np.where(rng.random(rows) < 0.3, "yes", " no "),
        "label": np.where(rng.random(rows) < 0.4, "ill", "well"),
        "part": np.where(rng.random(rows) < 0.2, "test", "train"),
        "id": np.arange(rows),
        **{f"v{i}": rng.normal(0, 2, rows).astype(np.float32) for i in range(40)}})
    if path.suffix == ".csv":
        pa_csv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("source", ["image-folder", "parquet"])
@pytest.mark.parametrize("batch", [8, "full"])
def test_a_seeded_dp_sgd_round_on_records_read_when_used_equals_in_memory(tmp_path, source,
                                                                        batch):
    if source == "image-folder":
        _images(tmp_path)
        lazy, eager = _lazy_and_eager(load_image_folder, tmp_path, IMAGES, lazy_mib=1)
        width = 3 * 64 * 64
    else:
        path = _table(tmp_path / "t.parquet", row_group_size=600)
        lazy, eager = _lazy_and_eager(load_table, path, TABLE, lazy_mib=1)
        width = 46
        batch = 400 if batch == 8 else batch  # 12 Poisson steps over 4,800 records
    config = DPSGDConfig(noise_multiplier=1.1, clip_norm=1.0, learning_rate=0.05,
                         batch_size=batch, physical_batch_size=64)
    results, models = [], []
    for data in (lazy, eager):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 3))
        results.append(train_dp(model, data.x_train, data.y_train, config, round_number=2,
                                seed=5))
        models.append(model)
    assert results[0].entries == results[1].entries
    assert results[0].sampled_examples == results[1].sampled_examples > 0
    for name, update in results[1].update.items():
        assert torch.equal(results[0].update[name], update), name
    assert evaluation_sums(models[0], lazy.x_test, lazy.y_test, batch_size=50) == \
        evaluation_sums(models[1], eager.x_test, eager.y_test, batch_size=50)


def test_a_table_larger_than_records_memory_is_spooled_and_a_step_reads_only_its_records(
        tmp_path, monkeypatch):
    """Past records-memory a table's converted records go to a spool on the silo's disk (no
    file left in its directory) and a Poisson step reads exactly its records from it."""
    path = _table(tmp_path / "t.parquet", row_group_size=320)
    spools = tmp_path / "spools"
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    data = load_table(_request(path, TABLE, 1))
    reader = data.x_train._read
    assert isinstance(reader, FileRows) and reader.row_shape == TABLE.input_shape
    assert list(spools.iterdir()) == []  # unlinked when made
    read: list[int] = []
    original = os.preadv

    def counted(descriptor, buffers, offset):
        read.append(sum(len(b) for b in buffers))
        return original(descriptor, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    mask = torch.rand(len(data.x_train), generator=torch.Generator().manual_seed(0)) < 0.01
    picked = data.x_train[mask]
    assert sum(read) == picked.numel() * 4  # the step's records, not their row groups


def test_the_image_cache_stays_within_records_memory_during_a_pass(tmp_path):
    _images(tmp_path, per_class=40)  # 1.4 MiB of pixels
    data = load_image_folder(_request(tmp_path, IMAGES, 1))
    reader = data.x_train._read
    assert isinstance(reader, ImageRows)
    for chunk in data.x_train.chunks(size=16):
        assert reader.cache.bytes <= reader.cache.capacity == 2**20
        assert torch.isfinite(chunk).all()
    assert reader.cache.peak <= 2**20
    assert 0 < len(reader.cache) < len(reader.paths)  # it did drop images


def test_an_image_that_does_not_decode_is_refused_at_start_up_when_read_lazily(tmp_path):
    _images(tmp_path)
    damaged = tmp_path / "2" / "005.png"
    damaged.write_bytes(damaged.read_bytes()[:300])
    lines = []
    for memory_mib in (0, 1024):
        with pytest.raises(DataError) as refused:
            load_image_folder(_request(tmp_path, IMAGES, memory_mib))
        lines.append(str(refused.value))
    assert lines[0] == lines[1]
    assert lines[0] == f"{damaged}: does not decode as an image ({lines[0].split('(')[-1]}"
    assert "\n" not in lines[0]


def test_a_missing_value_refused_in_memory_is_refused_at_start_up_when_read_lazily(tmp_path):
    path = _table(tmp_path / "t.parquet", row_group_size=620)
    refuse = Schema((46,), 2, class_names=("well", "ill"), features=TABLE.features)
    lines = []
    for memory_mib in (1, 1024):
        with pytest.raises(DataError) as refused:
            load_table(_request(path, refuse, memory_mib))
        lines.append(str(refused.value))
    ages = pq.read_table(path, columns=["age"]).column("age").to_numpy(zero_copy_only=False)
    first = int(np.flatnonzero(np.isnan(ages.astype(float)))[0]) + 1  # rows count from 1
    assert lines[0] == lines[1] == (f"{path}: column 'age' has missing values (null, empty "
                                    "or NaN) and the schema's missing-values rule is refuse "
                                    f"(row {first})")


def test_a_csv_larger_than_records_memory_is_read_when_used_like_parquet(tmp_path):
    csv = load_table(_request(_table(tmp_path / "t.csv", row_group_size=0), TABLE, 1))
    parquet = load_table(_request(_table(tmp_path / "t.parquet", row_group_size=320), TABLE, 1))
    assert isinstance(csv.x_train, LazyRecords) and isinstance(parquet.x_train, LazyRecords)
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(csv, f"x_{split}")[:], getattr(parquet, f"x_{split}")[:])
        assert torch.equal(getattr(csv, f"y_{split}"), getattr(parquet, f"y_{split}"))
