"""The warm ClientApp runtime serves a FAB from its process only if the FAB ships the code that
process runs, and a warm silo answers in its SuperNode (the deployment tests run it over gRPC)."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611

import dpcfl_flwr
from dpcfl_flwr.config import parse_node_config
from dpcfl_flwr.deploy.silo_file import SiloFile, supernode_command
from dpcfl_flwr.deploy.warm_runtime import (
    WarmRuntime,
    fab_matches_this_process,
    fab_ships_this_process,
)

HASH = "a06c43f2" + "0" * 56
PACKAGE = Path(dpcfl_flwr.__file__).parent


def _install_fab(home: Path, fab_hash: str = HASH) -> Path:
    """Lay out an installed FAB the way Flower's install_from_fab names it."""
    app = home / "apps" / f"dpcfl.dpcfl-flwr.0.1.0.{fab_hash[:8]}"
    shutil.copytree(PACKAGE, app / "dpcfl_flwr", ignore=shutil.ignore_patterns("__pycache__"))
    return app / "dpcfl_flwr"


def test_a_fab_with_this_process_code_is_served_warm(tmp_path):
    _install_fab(tmp_path)
    assert fab_matches_this_process(HASH, tmp_path)


def test_a_fab_with_other_code_is_not_served_warm(tmp_path):
    shipped = _install_fab(tmp_path)
    (shipped / "silo.py").write_text((shipped / "silo.py").read_text() + "\n# changed\n")
    assert not fab_matches_this_process(HASH, tmp_path)


def test_a_fab_with_an_extra_module_or_none_installed_is_not_served_warm(tmp_path):
    assert not fab_matches_this_process(HASH, tmp_path)  # not installed
    shipped = _install_fab(tmp_path)
    (shipped / "extra.py").write_text("x = 1\n")
    assert not fab_matches_this_process(HASH, tmp_path)


@pytest.fixture(scope="module")
def fab() -> bytes:
    """The FAB ``flwr run .`` sends, built by Flower from this checkout."""
    return build_fab_from_disk(PACKAGE.parent)


def _rewritten(fab: bytes, change) -> bytes:
    """``fab`` with ``change(name, data)`` -> data (None drops the file) applied to each file."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(fab)) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            data = change(name, source.read(name))
            if data is not None:
                target.writestr(name, data)
    return out.getvalue()


def test_a_fab_read_in_memory_is_served_warm_only_with_this_process_code(fab):
    assert fab_ships_this_process(fab)
    edited = _rewritten(fab, lambda name, data: data + b"\n# changed\n"
                        if name == "dpcfl_flwr/silo.py" else data)
    assert not fab_ships_this_process(edited)
    missing = _rewritten(fab, lambda name, data: None if name.endswith("ledger.py") else data)
    assert not fab_ships_this_process(missing)
    out = io.BytesIO(fab)
    with zipfile.ZipFile(out, "a") as archive:
        archive.writestr("dpcfl_flwr/extra.py", "x = 1\n")
    assert not fab_ships_this_process(out.getvalue())


def test_warm_silos_answer_in_the_supernode_without_its_own_superexec():
    node = parse_node_config({"partition-id": 0})
    warm = supernode_command(SiloFile(name="s", insecure=True, runtime_port=9123), node)
    cold = supernode_command(SiloFile(name="s", insecure=True, warm=False), node)
    assert warm[warm.index("--isolation") + 1] == "process" and "--clientapp-in-process" in warm
    assert cold[cold.index("--isolation") + 1] == "subprocess"
    assert "--clientapp-in-process" not in cold
    assert warm[warm.index("--port") + 1] == "9123"  # the fresh-process path for a new FAB


class Recorded(WarmRuntime):
    """The runtime's choice of path per task; the paths themselves are the deployment tests'."""

    def __init__(self, check_fab) -> None:
        super().__init__("127.0.0.1:1", app=None, check_fab=check_fab)  # type: ignore[arg-type]
        self.paths: list[str] = []

    def _run_here(self, token: str) -> None:
        self.paths.append("warm")

    def _run_cold(self, token: str) -> None:
        self.paths.append("cold")


@pytest.mark.parametrize("verdict, paths", [
    (True, ["warm", "warm"]),  # this process's code: warm from the first message
    (False, ["cold", "cold"]),  # other code: a fresh process per message
    (None, ["cold", "cold"]),  # not readable ahead: cold, then the installed FAB decides
])
def test_a_fab_read_ahead_decides_the_path_from_its_first_task(verdict, paths, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))  # nothing installed: cold stays cold
    checked: list[str] = []

    def check(task: Task):
        checked.append(task.fab_hash)
        return verdict

    runtime = Recorded(check)
    for _ in range(2):
        runtime.run(Task(fab_hash=HASH), token="t")
    assert runtime.paths == paths
    assert checked == [HASH]  # read once per FAB


def test_a_fab_that_cannot_be_read_ahead_falls_back_to_flowers_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    _install_fab(tmp_path)  # what the cold path installs: this process's code

    def unreadable(task: Task):
        raise zipfile.BadZipFile("not a zip")

    runtime = Recorded(unreadable)
    for _ in range(2):
        runtime.run(Task(fab_hash=HASH), token="t")
    assert runtime.paths == ["cold", "warm"]
