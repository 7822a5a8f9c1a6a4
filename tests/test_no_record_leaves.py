"""Nothing of a silo's records reaches the server but DP releases and N_i: a real deployment
(SuperLink over TLS with node authentication, two ``dpcfl client`` silos, ``flwr run``) whose
silos hold their own records under names, paths, columns and values that each carry a unique
marker. One silo reads a table, one an image folder, each under its own pinned schema; after
they joined, the table is damaged so that reading it fails at the run's first message, with an
error that names the file. Two runs follow, one with each silo's schema, so each silo meets a
run whose schema is not its own and the table silo fails on its records. No marker may appear
in anything the server side holds or printed: the SuperLink's and ServerApp's logs, the
SuperLink's state (every reply it stored), the runs' output and results; and every marker of
the damaged table must appear in that silo's own log (where its operator reads why).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
from PIL import Image

from dpcfl_flwr.deploy.localhost import LocalDeployment
from tests.test_deployment import _alive, _processes_of

REPO = Path(__file__).resolve().parents[1]

#: One marker for each kind of thing that must stay on the silo.
MARKERS = {"folder": "QZdirq7x", "table file": "QZfilek2", "column": "QZcolz9",
           "value": "QZvalw4", "image folder": "QZscnm3", "image file": "QZpatj8"}
TABLE_SCHEMA = ('features = "age:number(50,10), diag:category(A|B)"\n'
                'label-column = "label"\nnum-classes = 2\n')
IMAGE_SCHEMA = 'input-shape = "1,8,8"\nnum-classes = 2\nclass-names = "benign,malignant"\n'
RECORDS = 60


def _table(root: Path) -> tuple[Path, Path]:
    """A table silo's records and schema file, under the markers' folder and file names and
    with an ignored column whose values carry the value marker."""
    folder = root / MARKERS["folder"]
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    table = pa.table({
        "age": [f"{v:.1f}" for v in rng.normal(50, 10, RECORDS)],
        "diag": ["A" if i % 2 else "B" for i in range(RECORDS)],
        MARKERS["column"]: [f"{MARKERS['value']}-{i}" for i in range(RECORDS)],
        "label": [i % 2 for i in range(RECORDS)]})
    pa_csv.write_csv(table, folder / f"{MARKERS['table file']}.csv")
    (folder / "schema.toml").write_text(TABLE_SCHEMA)
    return folder / f"{MARKERS['table file']}.csv", folder / "schema.toml"


def _images(root: Path) -> tuple[Path, Path]:
    """An image-folder silo's records: files named by the image-file marker (a patient id,
    say) under a folder named by the image-folder marker."""
    scans = root / MARKERS["image folder"]
    rng = np.random.default_rng(1)
    for index in range(RECORDS):
        name = "malignant" if index % 2 else "benign"
        (scans / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(
            scans / name / f"{MARKERS['image file']}-{index:03d}.png")
    (root / "image-schema.toml").write_text(IMAGE_SCHEMA)
    return scans, root / "image-schema.toml"


def _own_records(deployment: LocalDeployment, index: int, source: str, path: Path,
                 schema: Path, ignore: str = "") -> None:
    silo_file = deployment.root / "clients" / f"silo-{index:02d}.toml"
    silo_file.write_text(silo_file.read_text() + (
        f'data-source = "{source}"\ndata-path = "{path}"\nschema-file = "{schema}"\n'
        + (f'ignore-columns = "{ignore}"\n' if ignore else "")))


def _server_side(deployment: LocalDeployment) -> dict[str, bytes]:
    """Everything the server side holds or printed: its logs, its state (the SuperLink's
    database of messages and replies), the runs' output and results directories."""
    root = deployment.root
    files = [root / "server.log", *root.glob("run-*.log"), *root.glob("run-*/**/*"),
             *(root / "state").rglob("*"), *(root / "flwr").rglob("*")]
    return {str(f): f.read_bytes() for f in files if f.is_file()}


@pytest.mark.slow
def test_no_path_name_column_or_value_of_a_silos_records_reaches_the_server(tmp_path):
    deployment = LocalDeployment(tmp_path / "deployment", clusters="2")
    deployment.up()
    app = deployment.use_snapshot(REPO)
    table, table_schema = _table(tmp_path / "site-a")
    scans, image_schema = _images(tmp_path / "site-b")
    _own_records(deployment, 0, "table", table, table_schema, MARKERS["column"])
    _own_records(deployment, 1, "image-folder", scans, image_schema)
    try:
        for index in (0, 1):
            deployment.silo(index)
        _wait_for_start(deployment)
        # after it joined, the table gets a value its schema does not list: reading it at
        # the run's first message fails with an error naming the file
        with table.open("a") as handle:
            handle.write(f'"51.0","{MARKERS["value"]}","x","1"\n')
        common = {"method": '"local"', "model": '"mlp"', "num-server-rounds": 2,
                  "eval-every": 2, "batch-size": 8, "epsilon": 5.0,
                  "wait-for-clients": 60.0}
        for name, schema in (("run-images", IMAGE_SCHEMA), ("run-table", TABLE_SCHEMA)):
            keys = dict(line.split(" = ", 1) for line in schema.strip().splitlines())
            run = deployment.flwr_run(name, app, **common, **keys)
            run.wait(timeout=600)
        assert (deployment.root / "run-images" / "results.json").exists()
        server = _server_side(deployment)
        for kind, marker in MARKERS.items():
            leaked = [path for path, text in server.items() if marker.encode() in text]
            assert not leaked, f"the {kind} marker reached the server side: {leaked}"
        assert any(b"from this silo's pinned schema" in text
                   for text in server.values())  # the refusals did reach the server
        assert any(b"the silo's records cannot be read under its schema" in text
                   for text in server.values())
        silo_log = deployment.log("silo-00")  # the operator's log says why, in full
        for kind in ("folder", "table file"):
            assert MARKERS[kind] in silo_log, silo_log[-3000:]
    finally:
        pids = _processes_of(deployment)
        deployment.down()
        assert not _alive(pids), "processes outlived the deployment"


def _wait_for_start(deployment: LocalDeployment, timeout: float = 180) -> None:
    """Until both silos' SuperNodes run (each supervisor checked its records first)."""
    deadline = time.monotonic() + timeout
    while not all("command" in deployment.log(f"silo-{i:02d}") for i in (0, 1)):
        for name, process in deployment.processes.items():
            assert process.poll() is None, f"{name} ended: {deployment.last_line(name)}"
        assert time.monotonic() < deadline, "the silos did not start"
        time.sleep(0.5)
