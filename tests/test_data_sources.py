"""Data sources behind one interface: the federation's schema, installed plug-ins, a silo's
own records in simulation, and `dpcfl data check` (docs/own-data.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dpcfl_flwr.config.config_file import load_schema
from dpcfl_flwr.config.settings import ConfigError, parse_node_config, parse_run_config
from dpcfl_flwr.data import DataError
from dpcfl_flwr.data.schema import Feature, Schema, parse_features
from dpcfl_flwr.data.sources import (
    ENTRY_POINT_GROUP,
    SourceRequest,
    draw_split,
    load_records,
    source_names,
)
from dpcfl_flwr.silo.silo import client_records

DPCFL = str(Path(sys.executable).with_name("dpcfl"))


# --- the schema ------------------------------------------------------------------------------
def test_features_grammar_gives_columns_in_order_with_their_widths():
    features = parse_features("age:number(54,9), bp : number, sex:category(f|m), "
                              "smoker:category(no|yes|former)")
    assert features == (Feature("age", "number", mean=54.0, scale=9.0),
                        Feature("bp", "number"), Feature("sex", "category", ("f", "m")),
                        Feature("smoker", "category", ("no", "yes", "former")))
    assert [f.width for f in features] == [1, 1, 2, 3]
    config = parse_run_config({"features": "age:number(54,9), bp:number, sex:category(f|m)",
                               "num-classes": 2, "model": "cnn"})
    assert config.record_shape == (4,)  # 1 + 1 + 2 model inputs
    assert config.data_schema.features[2].categories == ("f", "m")


def test_a_column_range_names_one_column_per_integer():
    written = parse_features(", ".join(f"px{i}:number(0.5,0.25)" for i in range(784))
                             + ", sex:category(f|m)")
    assert parse_features("px{0..783}:number(0.5,0.25), sex:category(f|m)") == written
    assert [f.name for f in parse_features("a{7..8}b:number")] == ["a7b", "a8b"]
    with pytest.raises(ValueError, match="more than 100,000 columns"):  # before building any
        parse_features("p{0..999999999}:number")
    with pytest.raises(ValueError, match="'p{3..1}': the range runs backwards"):
        parse_features("p{3..1}:number")


@pytest.mark.parametrize("features, words", [
    ("age", "expected 'name:number'"),
    ("age:number(54)", "two numbers"),
    ("age:number(54,0)", "scale positive"),
    ("sex:category(f)", "at least two values"),
    ("sex:category(f|f)", "listed twice"),
    ("age:number, age:number", "'age' is listed twice"),
])
def test_a_bad_feature_list_is_one_line(features, words):
    with pytest.raises(ConfigError, match="features") as caught:
        parse_run_config({"features": features})
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_schema_keys_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="does not match the features' width 3"):
        parse_run_config({"features": "a:number, b:category(x|y)", "input-shape": "4"})
    with pytest.raises(ConfigError, match="2 names for 3 classes"):
        parse_run_config({"class-names": "cat,dog", "num-classes": 3})
    one = parse_run_config({"input-shape": "3,8,8", "image-mean": 0.5, "image-std": 0.25})
    assert one.data_schema.image_mean == (0.5,)  # --set image-mean=0.5 arrives as a number
    with pytest.raises(ConfigError, match="image-mean gives 2 values for 3 channels"):
        parse_run_config({"input-shape": "3,8,8", "image-mean": "0.5,0.5", "image-std": "1,1"})


def test_a_schema_file_is_the_run_configs_schema_keys(tmp_path):
    path = tmp_path / "schema.toml"
    path.write_text('input-shape = "3,16,16"\nnum-classes = 4\nclass-names = "a,b,c,d"\n'
                    'image-mean = "0.5"\nimage-std = "0.25"\nmethod = "rdpcfl"\n')
    schema = load_schema(path)
    assert schema == Schema((3, 16, 16), 4, ("a", "b", "c", "d"), image_mean=(0.5,),
                            image_std=(0.25,))
    assert schema.class_index("c") == 2 and schema.class_index("e") is None
    (tmp_path / "empty.toml").write_text('method = "rdpcfl"\n')
    with pytest.raises(ConfigError, match="no schema keys"):
        load_schema(tmp_path / "empty.toml")


def test_draw_split_is_seeded_disjoint_and_sorted():
    parts = draw_split(100, 7, 0.25, 0.2)
    assert [len(parts[s]) for s in ("train", "val", "test")] == [60, 20, 20]
    rows = np.concatenate(list(parts.values()))
    assert sorted(rows.tolist()) == list(range(100))
    assert all((np.diff(p) > 0).all() for p in parts.values())
    again = draw_split(100, 7, 0.25, 0.2)
    assert all((parts[s] == again[s]).all() for s in parts)
    assert not (draw_split(100, 8, 0.25, 0.2)["test"] == parts["test"]).all()


# --- plug-ins --------------------------------------------------------------------------------
def _install_plugin(root: Path, body: str, name: str = "ones") -> None:
    """An installed package as importlib.metadata finds one: a module and a .dist-info
    directory with its entry points, on a directory of sys.path."""
    (root / "myplugin.py").write_text(textwrap.dedent(body))
    info = root / "myplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{name} = myplugin:load\nbroken = myplugin:missing\n")


PLUGIN = """
    import torch
    from dpcfl_flwr.data.partition import ClientData

    def load(request):
        if request.path.name == "raise":
            raise RuntimeError("the database is down")
        n = 10 + request.client_id
        x = torch.full((n, *request.schema.input_shape), float(request.seed))
        y = torch.arange(n) % request.schema.num_classes
        return ClientData(request.client_id, -1, x, y, x[:0], y[:0], x[:2], y[:2])
"""


def test_an_installed_plugin_is_a_source(tmp_path, monkeypatch):
    _install_plugin(tmp_path, PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_names()[:4] == ("benchmark", "arrays", "image-folder", "table")
    assert "ones" in source_names()
    request = SourceRequest(tmp_path / "db", 3, 5, 0.25, 0.2, Schema((2, 4), 3))
    data = load_records("ones", request)
    assert data.num_train == 13 and tuple(data.x_train.shape) == (13, 2, 4)
    assert float(data.x_train.max()) == 5.0 and data.y_train.tolist()[:4] == [0, 1, 2, 0]
    # through a silo's own node config and the federation's schema
    node = parse_node_config({"partition-id": 1, "epsilon": 1.0, "delta": 1e-5,
                              "ledger-path": str(tmp_path / "l.json"), "data-source": "ones",
                              "data-path": str(tmp_path / "db"), "data-seed": 2})
    settings = node.resolved(parse_run_config({}), trust_run_config=False)
    records = client_records(settings, Schema((1, 28, 28), 10))
    assert records.num_train == 11 and float(records.x_train.mean()) == 2.0


def test_a_plugin_that_fails_or_is_missing_is_one_line(tmp_path, monkeypatch):
    _install_plugin(tmp_path, PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    request = SourceRequest(tmp_path / "raise", 0, 0, 0.25, 0.2, Schema((2,), 2))
    with pytest.raises(DataError, match=r"data-source 'ones' failed on .*raise: "
                                        r"RuntimeError: the database is down"):
        load_records("ones", request)
    with pytest.raises(DataError, match=r"data-source 'broken' \(myplugin:missing\) cannot "
                                        "be loaded: AttributeError"):
        load_records("broken", request)
    with pytest.raises(ConfigError, match="'data-source' = 'nowhere' is invalid: not a data "
                                          "source installed on this silo; choose from "
                                          "benchmark, arrays"):
        parse_node_config({"partition-id": 0, "data-source": "nowhere"})


# --- a silo's own records in simulation -------------------------------------------------------
def test_silo_data_paths_name_each_silos_records():
    listed = parse_run_config({"clusters": "1,2", "data-source": "arrays",
                               "silo-data-paths": "a.npz, b.npz,c.npz"})
    assert [listed.silo_overrides(i)["data_path"] for i in range(3)] == [
        "a.npz", "b.npz", "c.npz"]
    assert [listed.silo_overrides(i)["true_cluster"] for i in range(3)] == [0, 1, 1]
    template = parse_run_config({"clusters": "2,2", "data-source": "table",
                                 "silo-data-paths": "sites/site-{partition}.csv"})
    assert template.silo_overrides(3)["data_path"] == "sites/site-3.csv"
    with pytest.raises(ConfigError, match="silo-data-paths gives 2 paths for 3 silos"):
        parse_run_config({"clusters": "1,2", "silo-data-paths": "a.npz,b.npz"})


# --- dpcfl data check --------------------------------------------------------------------------
def _dpcfl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([DPCFL, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)


def test_dpcfl_data_check_shows_the_records_and_whether_they_fit(tmp_path):
    rng = np.random.default_rng(0)
    y = np.array([0] * 7 + [1] * 13 + [2] * 20)
    np.savez(tmp_path / "records.npz", x=rng.normal(size=(40, 1, 6, 6)).astype(np.float32),
             y=y)
    (tmp_path / "silo.toml").write_text(textwrap.dedent("""
        name = "site-a"
        [node]
        partition-id = 0
        data-source = "arrays"
        data-path = "records.npz"
        test-fraction = 0.25
        val-fraction = 0.2
        schema-file = "schema.toml"
    """))
    (tmp_path / "schema.toml").write_text('input-shape = "1,6,6"\nnum-classes = 3\n')
    (tmp_path / "wrong.toml").write_text('input-shape = "1,8,8"\nnum-classes = 3\n')
    fits = _dpcfl("data", "check", "silo.toml", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr
    split = draw_split(40, 0, 0.2, 0.25)  # the silo's data-seed defaults to 0
    counts = np.bincount(y[split["train"]], minlength=3)
    assert f"{len(split['train'])} / {len(split['val'])} / {len(split['test'])}" in fits.stdout
    assert ", ".join(f"{c}: {n}" for c, n in enumerate(counts)) in fits.stdout
    assert "1x6x6" in fits.stdout and "yes" in fits.stdout
    assert "fewer than 4 batches of 32" in " ".join(fits.stdout.split())  # 24 train records
    misfit = _dpcfl("data", "check", "silo.toml", "--schema", "wrong.toml", cwd=tmp_path)
    assert misfit.returncode == 2
    assert "train records have shape (1, 6, 6), the federation's schema says (1, 8, 8)" in (
        " ".join(misfit.stderr.split()))
    (tmp_path / "records.npz").unlink()
    missing = _dpcfl("data", "check", "silo.toml", cwd=tmp_path)
    assert missing.returncode == 2 and "records.npz: no such file" in missing.stderr


def test_dpcfl_client_checks_records_against_its_schema_file_before_it_joins(tmp_path):
    np.savez(tmp_path / "records.npz", x=np.zeros((20, 5), np.float32),
             y=np.arange(20) % 4)
    (tmp_path / "schema.toml").write_text('input-shape = "5"\nnum-classes = 3\n')
    (tmp_path / "silo.toml").write_text(textwrap.dedent(f"""
        name = "site-b"
        insecure = true
        [node]
        partition-id = 0
        epsilon = 1.0
        delta = 1e-5
        ledger-path = "{tmp_path / 'ledger.json'}"
        data-source = "arrays"
        data-path = "records.npz"
        schema-file = "schema.toml"
    """))
    result = _dpcfl("client", "silo.toml", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert "labels outside the schema's 3 classes (0..2)" in " ".join(
        (result.stdout + result.stderr).split())
    # records that fit: the plan says what the silo trains on, its source, file and schema
    np.savez(tmp_path / "records.npz", x=np.zeros((20, 5), np.float32), y=np.arange(20) % 3)
    fits = _dpcfl("client", "silo.toml", "--dry-run", cwd=tmp_path)
    plan = " ".join(fits.stdout.split())
    assert fits.returncode == 0, fits.stderr
    assert f"own records (arrays) at {tmp_path / 'records.npz'}, pinned schema" in plan
    assert "fmnist" not in plan
    # without its schema file (compose passes an empty one), a silo on its own records does
    # not start
    (tmp_path / "silo.toml").write_text((tmp_path / "silo.toml").read_text().replace(
        'schema-file = "schema.toml"', ""))
    unpinned = _dpcfl("client", "silo.toml", "--schema-file", "", "--dry-run", cwd=tmp_path)
    assert unpinned.returncode == 2 and "set schema-file" in " ".join(
        (unpinned.stdout + unpinned.stderr).split())


@pytest.mark.slow
def test_a_simulation_trains_on_each_silos_own_records(tmp_path):
    """Four silos, each with its own .npz of rotated Fashion-MNIST records (two groups),
    named by silo-data-paths: R-DPCFL runs to the end on them, each silo with its own N_i."""
    from dpcfl_flwr.data import Topology, load_dataset, make_client_data
    from dpcfl_flwr.runs.simulation import run_simulation

    train, test = load_dataset("fmnist", None)
    sizes = [150, 160, 170, 180]
    for i, n in enumerate(sizes):
        data = make_client_data(train, test, i, Topology((2, 2)), "rotation", n, seed=0,
                                test_samples=100)
        np.savez(tmp_path / f"silo-{i}.npz", x_train=data.x_train.numpy(),
                 y_train=data.y_train.numpy(), x_test=data.x_test.numpy(),
                 y_test=data.y_test.numpy())
    out = tmp_path / "run"
    experiment = parse_run_config({
        "clusters": "2,2", "data-source": "arrays", "rdpcfl.n-clusters": 2,
        "silo-data-paths": str(tmp_path / "silo-{partition}.npz"), "num-server-rounds": 3,
        "eval-every": 3, "out-dir": str(out)})
    run_simulation(experiment)
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True
    clients = sorted(results["clients"], key=lambda c: c["partition"])
    assert [c["num_train"] for c in clients] == sizes
    assert [c["true_cluster"] for c in clients] == [0, 0, 1, 1]
    accuracies = torch.tensor([c["test_accuracy"] for c in clients])
    assert bool(((accuracies > 0) & (accuracies <= 100)).all())


@pytest.mark.parametrize(("make", "words"), [
    (lambda rng: (rng.integers(0, 256, (400, 1, 6, 6)), np.arange(400) % 3),
     ["input values reach 255"]),
    (lambda rng: (rng.normal(size=(400, 1, 6, 6)), (np.arange(400) % 10 == 0).astype(int)),
     ["class 0 holds 9", "balanced accuracy"]),
    (lambda rng: (rng.normal(size=(400, 1, 6, 6)), np.arange(400) % 3), []),
])
def test_the_check_warns_of_what_will_train_badly(tmp_path, make, words):
    """Raw pixels, a label most records share: they fit the schema, and train badly."""
    from dpcfl_flwr.data.arrays import load_arrays
    from dpcfl_flwr.data.summary import summarise

    x, y = make(np.random.default_rng(3))
    np.savez(tmp_path / "r.npz", x=x.astype(np.float32), y=y)
    summary = summarise(load_arrays(tmp_path / "r.npz", 0, 0, 0.2, 0.2), Schema((1, 6, 6), 3),
                        "r.npz")
    assert summary.problem is None
    said = " ".join(summary.warnings)
    assert all(word in said for word in words) and bool(words) == bool(summary.warnings), said
