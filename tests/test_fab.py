"""The FAB that ``flwr run .`` sends to every SuperNode: the app's code and nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_fab_carries_the_package_and_its_config_only(tmp_path):
    app = tmp_path / "dpcfl-app"  # `flwr build` refuses a directory name like pytest's
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split("\0")[:-1]
    for name in tracked:  # the repository as a fresh clone has it, built where it is safe
        target = app / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, target)
    flwr = Path(sys.executable).with_name("flwr")
    built = subprocess.run([str(flwr), "build"], cwd=app, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    (fab,) = app.glob("*.fab")
    names = zipfile.ZipFile(fab).namelist()
    assert {n.split("/")[0] for n in names} == {".info", "dpcfl_flwr", "pyproject.toml"}
    shipped = {n for n in names if n.startswith("dpcfl_flwr/")}
    package = {str(p.relative_to(REPO)) for p in (REPO / "dpcfl_flwr").rglob("*.py")
               if str(p.relative_to(REPO)) in tracked}
    assert shipped == package  # every module of the app, so a SuperNode can run it
