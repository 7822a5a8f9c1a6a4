"""Silos on their own records, deployed: three real ``dpcfl client`` silos over TLS with node
authentication, each silo file naming its own table of a real data set (the RAND Health
Insurance Experiment, one site per silo: examples/rand_hie.py), one of them reading it through
a data-source plug-in and every party building a plug-in model, both from a small package
installed with pip. Every process runs from one virtual environment, as a site operator would
have it: the plug-in package, dpcfl-flwr (the snapshot the run submits) and flwr installed into
it, the heavy dependencies (torch, opacus, ...) seen from the test's environment through a
``.pth`` file. Driven by ``flwr run`` as on real machines."""

from __future__ import annotations

import json
import shutil
import site
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


def _silo_venv(root: Path, app: Path) -> Path:
    """A site's virtual environment with pip-installed plug-ins, ``app``'s dpcfl-flwr and flwr
    1.39, each with its commands (``bin/dpcfl``, ``bin/flower-supernode``, ...) on the venv's
    Python. Returns the venv."""
    venv = root / "silo-venv"
    # sys.executable is the test's venv: its python makes a venv of the base interpreter
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True)
    packages = Path(purelib.stdout.strip())
    # installed dependencies (and pip) come from the test's environment: .pth lines go after
    # the venv's own site-packages, so what is installed into the venv wins
    (packages / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _pip(python, "--no-build-isolation", _plugin_source(root))
    source = root / "app-src"  # the snapshot's package, with the README its metadata names
    shutil.copytree(app / "dpcfl_flwr", source / "dpcfl_flwr",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(app / "pyproject.toml", source / "pyproject.toml")
    shutil.copy(REPO / "README.md", source / "README.md")
    # dpcfl-flwr builds with hatchling, which the test's environment lacks: build isolation
    _pip(python, str(source), "flwr==1.39.0")
    assert (next(packages.glob("site_plugins-0.1.dist-info")) / "entry_points.txt").exists()
    return venv


def _pip(python: str, *args: str) -> None:
    # --ignore-installed: flwr is also seen through the .pth, and is installed anyway (its
    # commands must run the venv's Python) without touching the test's environment
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed",
                    *args], check=True, capture_output=True, timeout=300)


def _plugin_source(root: Path) -> str:
    """The plug-in package's source tree (what a site would ``pip install``)."""
    source = root / "plugin-src"
    (source / "site_plugins").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (source / "site_plugins" / "__init__.py").write_text(PLUGIN_MODULE)
    return str(source)


def _argv0(pid: int) -> str | None:
    """The program ``pid`` was started as (its command line's first word); None once gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return None


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
    venv_bin = tmp_path / "silo-venv" / "bin"
    deployment = LocalDeployment(tmp_path / "deployment", clusters="2,1", bin_dir=venv_bin)
    app = deployment.use_snapshot(REPO)
    started = time.monotonic()
    _silo_venv(tmp_path, app)
    print(f"\nsilo venv set up in {time.monotonic() - started:.0f} s")
    # the venv holds the snapshot the run submits: every process (the SuperLink's ServerApp
    # builds the plug-in model too) runs what is installed in it, nothing from PYTHONPATH
    del deployment.env["PYTHONPATH"]
    deployment.up()
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
                      "features": f'"{example.features_schema()}"',
                      "label-column": f'"{example.LABEL}"',
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
        # the SuperLink, the silos' supervisors, SuperNodes and ClientApp runtimes: all the venv's
        running = {pid: _argv0(pid) for pid in _processes_of(deployment)}
        assert len(running) > 2 * len(own) + 1, running
        assert all(Path(argv0).parent == venv_bin for argv0 in running.values()
                   if argv0 is not None), running
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
