"""What the tests of the docs' walkthroughs share (test_readme_deployment,
test_own_data_walkthrough): a page's section, its code blocks and shell commands read from the
page itself, and an operator that runs them in a copy of this checkout, each process in a
session of its own, every one of them killed at the end."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from dpcfl_flwr.runs.processes import descendants

REPO = Path(__file__).resolve().parents[1]


def section(page: Path, heading: str) -> str:
    """The text of ``page``'s level-2 section whose heading starts with ``heading``, up to
    the next level-2 heading."""
    text = page.read_text()
    marker = f"\n## {heading}"
    assert marker in text, f"{page.name} has no section '## {heading}'"
    start = text.index(marker) + 1
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of ``text``'s fenced code blocks in ``language``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block, in order (continued lines joined, comments dropped)."""
    return [words for line in block.replace("\\\n", " ").splitlines()
            if (words := shlex.split(line, comments=True))]


def only_command(commands: list[list[str]], *start: str, where: str) -> list[str]:
    """The one command of ``commands`` that starts with the words ``start``."""
    found = [c for c in commands if c[:len(start)] == list(start)]
    assert len(found) == 1, f"{where} has no single {' '.join(start)!r}"
    return found[0]


def copy_of_the_checkout(root: Path) -> None:
    """What a fresh clone holds and the commands use, copied to ``root`` (the virtualenv
    linked): the walkthroughs write certs/, state/, clients/ there, never here."""
    for name in ("server", "clients", "examples", "dpcfl_flwr"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")


def listening(port: int) -> bool:
    """Whether a process listens on TCP ``port`` (from ss)."""
    return subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                          text=True, check=False).stdout.strip() != ""


class Operator:
    """Runs commands in the checkout's copy as the docs' operator would, each in a session
    of its own, with its output in a log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr"), "FLWR_TELEMETRY_ENABLED": "0",
                    "PYTHONPATH": str(root), "COLUMNS": "200"}
        self.processes: dict[str, subprocess.Popen] = {}

    def run(self, name: str, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=self.root, env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        (self.root / f"{name}.log").write_text(done.stdout + done.stderr)
        return done

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with (self.root / f"{name}.log").open("w") as log:
            process = subprocess.Popen(command, cwd=self.root, env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            assert self.processes[name].poll() is None, f"{name} ended:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"no {text!r} in {name}:\n{self.log(name)}"
            time.sleep(0.5)

    def kill_all(self) -> None:
        tree = {pid for p in self.processes.values() for pid in descendants(p.pid)}
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes.values():
            process.wait()
