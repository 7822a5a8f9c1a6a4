"""Silos on their own records, deployed: three real ``dpcfl client`` silos over TLS with node
authentication, each silo file naming its own table of a real data set (the RAND Health
Insurance Experiment, one site per silo: examples/rand_hie.py), one of them reading it through
a data-source plug-in and every party building a plug-in model, both from a small package
installed with pip. Driven by ``flwr run`` as on real machines."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpcfl_flwr.deploy.localhost import LocalDeployment
from tests.test_deployment import _alive, _processes_of

REPO = Path(__file__).resolve().parents[1]
SITES = (1, 3, 5)  # sites 1 and 3 of the first group, site 5 of the second

PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "site-plugins"
version = "0.1"

[project.entry-points."dpcfl_flwr.data_sources"]
jsonl-table = "site_plugins:load_jsonl"

[project.entry-points."dpcfl_flwr.models"]
logreg = "site_plugins:logistic_regression"
"""

PLUGIN_MODULE = '''
"""A site's own code: its records as JSON lines, and a logistic regression."""
import json

import torch

from dpcfl_flwr.data.partition import ClientData

FEATURES_FILE = "features.json"


def load_jsonl(request):
    """One record a line: {"x": [...], "y": label, "split": "train" | "test"}."""
    parts = {"train": ([], []), "test": ([], [])}
    with open(request.path) as handle:
        for line in handle:
            record = json.loads(line)
            parts[record["split"]][0].append(record["x"])
            parts[record["split"]][1].append(record["y"])
    x_train, y_train = (torch.tensor(v) for v in parts["train"])
    x_test, y_test = (torch.tensor(v) for v in parts["test"])
    x_train, x_test = x_train.float(), x_test.float()
    return ClientData(request.client_id, -1, x_train, y_train, x_train[:0], y_train[:0],
                      x_test, y_test)


def logistic_regression(num_classes, input_shape):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(input_shape[0], num_classes))
'''


def _install_plugins(root: Path) -> Path:
    """Build and install the plug-in package with pip into its own directory (what a site
    does with ``pip install``); returns the directory to put on the path."""
    source = root / "plugin-src"
    (source / "site_plugins").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (source / "site_plugins" / "__init__.py").write_text(PLUGIN_MODULE)
    target = root / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=300)
    assert (next(target.glob("site_plugins-0.1.dist-info")) / "entry_points.txt").exists()
    return target


def _as_json_lines(csv_path: Path, schema, out: Path) -> Path:
    """The site's table as the plug-in's JSON lines, its features built to the schema."""
    from dpcfl_flwr.data.sources import SourceRequest
    from dpcfl_flwr.data.table import load_table

    data = load_table(SourceRequest(csv_path, 0, 0, 0.25, 0.2, schema,
                                    {"split-column": "split"}))
    with out.open("w") as handle:
        for split in ("train", "test"):
            x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
            for row, label in zip(x.tolist(), y.tolist(), strict=True):
                handle.write(json.dumps({"x": row, "y": label, "split": split}) + "\n")
    return out


@pytest.mark.slow
def test_three_silos_train_on_their_own_tables_over_tls_with_installed_plugins(tmp_path):
    from dpcfl_flwr.config.config_file import load_schema

    example = _example()
    data = tmp_path / "data"
    paths = example.export(data, SITES)
    schema = load_schema(data / "schema.toml")
    plugins = _install_plugins(tmp_path)
    deployment = LocalDeployment(tmp_path / "deployment", clusters="2,1")
    deployment.env["PYTHONPATH"] = str(plugins)  # the SuperLink's ServerApp builds the model
    deployment.up()
    deployment.use_snapshot(REPO)
    deployment.env["PYTHONPATH"] = f"{deployment.root}:{plugins}"
    own = {0: ("table", paths[0]), 1: ("table", paths[1]),
           2: ("jsonl-table", _as_json_lines(paths[2], schema, data / "site-5.jsonl"))}
    for index, (source, path) in own.items():
        silo_file = deployment.root / "clients" / f"silo-{index:02d}.toml"
        silo_file.write_text(silo_file.read_text() + textwrap.dedent(f"""
            data-source = "{source}"
            data-path = "{path}"
            split-column = "split"
            schema-file = "{data / 'schema.toml'}"
        """))
    try:
        for index in own:
            deployment.silo(index)
        run_config = {"method": '"global"', "model": '"logreg"', "num-classes": 2,
                      "features": f'"{example.features_schema()}"', "label-column": '"binexp"',
                      "missing-values": '"fill"', "num-server-rounds": 6, "eval-every": 3,
                      "batch-size": 64, "learning-rate": 0.1, "clip-norm": 1.0,
                      "epsilon": 5.0}
        started = time.monotonic()
        run = deployment.flwr_run("run-own", deployment.root, **run_config)
        assert run.wait(timeout=900) == 0, deployment.log("server")
        wall = time.monotonic() - started
        results = json.loads((deployment.root / "run-own" / "results.json").read_text())
        assert results["complete"] and len(results["clients"]) == 3
        clients = sorted(results["clients"], key=lambda c: c["partition"])
        # each silo's N_i is the count of its site's training persons' rows
        expected = [sum(1 for line in path.read_text().splitlines()[1:]
                        if line.endswith(",train")) for path in paths]
        assert [c["num_train"] for c in clients] == expected
        assert all(c["epsilon_spent"] <= c["epsilon_budget"] for c in clients)
        assert all(0.5 < c["test_accuracy"] <= 1.0 for c in clients)
        for index in own:
            log = deployment.log(f"silo-{index:02d}")
            assert "model logreg trains with the layerwise engine" in log, log[-3000:]
        print(f"\nthree silos on their own tables over TLS: {wall:.0f} s wall, accuracies "
              f"{[round(c['test_accuracy'], 3) for c in clients]}")
    finally:
        pids = _processes_of(deployment)
        deployment.down()
        assert not _alive(pids), "processes outlived the deployment"


def _example():
    sys.path.insert(0, str(REPO))
    try:
        from bench.common import script_module
    finally:
        sys.path.remove(str(REPO))
    return script_module(REPO / "examples" / "rand_hie.py")
