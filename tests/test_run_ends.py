"""A run ends, as an operator starts it (real processes, Flower and Ray unmocked).

A simulation in which no silo can start (a truncated data file) stops with one error line and a
non-zero status, each silo's reason logged once; Ctrl-C in a terminal ends a simulation or a
silo (``dpcfl client``) within seconds, and no process of theirs is left. A connected silo's
supervisor, alive as long as the silo, holds no torch: only its SuperNode trains.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from dpcfl_flwr.data.readers import FASHION_MNIST_DEBIAN_DIR, FASHION_MNIST_ENV_VAR
from dpcfl_flwr.deploy.localhost import LocalDeployment, free_port
from dpcfl_flwr.runs.processes import descendants

DPCFL = [sys.executable, "-m", "dpcfl_flwr.cli"]
REPO = Path(__file__).resolve().parents[1]
TINY = {"clusters": '"1,2"', "rdpcfl.n-clusters": 2, "samples-per-client": 64, "test-samples": 40}
SILOS = 3
ENDS_WITHIN = 10.0  # s from Ctrl-C to exit: about 3 s here, 5 s at most before a kill


def _settings(**extra: object) -> list[str]:
    return [arg for key, value in {**TINY, **extra}.items()
            for arg in ("--set", f"{key}={value}")]


def _marked_env() -> tuple[dict[str, str], bytes]:
    """An environment whose mark every process started with it inherits (Ray's too)."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "DPCFL_TEST_RUN": mark, "COLUMNS": "200",
           "FLWR_TELEMETRY_ENABLED": "0"}
    return env, f"\0DPCFL_TEST_RUN={mark}\0".encode()


def _marked(mark: bytes) -> set[int]:
    """The running processes (not zombies) whose environment holds ``mark``."""
    found = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and mark in b"\0" + (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    found.add(int(entry.name))
    return found


def _left_after(mark: bytes, grace: float = 3.0) -> set[int]:
    deadline = time.monotonic() + grace
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # do not leak them into the next test
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def _fashion_mnist() -> Path:
    return Path(os.environ.get(FASHION_MNIST_ENV_VAR) or FASHION_MNIST_DEBIAN_DIR)


def test_a_simulation_where_no_silo_can_start_ends_with_one_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for source in _fashion_mnist().glob("*-ubyte.gz"):
        (data / source.name).symlink_to(source)
    labels = data / "train-labels-idx1-ubyte.gz"
    truncated = labels.read_bytes()[:2000]
    labels.unlink()
    labels.write_bytes(truncated)
    env, mark = _marked_env()
    started = time.monotonic()
    run = subprocess.run([*DPCFL, "simulate", "--quiet", "--out", str(tmp_path / "run"),
                          *_settings(**{"data-dir": f'"{data}"', "num-server-rounds": 2})],
                         capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - started
    assert run.returncode == 1, run.stderr
    assert elapsed < 120  # Ray's start and one query; before, it re-asked for 600 s
    said = [line for line in run.stdout.splitlines() if "cannot start" in line]
    assert len(said) == SILOS and all("DataError" in line for line in said)
    error = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(error) == 1, run.stderr
    assert error[0].startswith(f"error: 0 of {SILOS} silos can run ({SILOS} failed to start: "
                               "DataError: silo ")  # a refusal names its silo, then the file
    assert f"{labels}: corrupt or truncated gzip data" in error[0]
    assert "Traceback" not in run.stdout + run.stderr
    assert not (tmp_path / "run" / "ledgers").exists()  # no silo was asked to train
    assert not _left_after(mark)
    print(f"\nno silo can start: exit {run.returncode} after {elapsed:.1f} s, "
          f"{len(said)} lines naming the cause")


class Terminal:
    """A pseudo-terminal that ``command`` runs in as the foreground job of a session of its
    own: Ctrl-C is SIGINT to its whole process group, as a terminal sends it."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        master, slave = pty.openpty()
        self.process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave,
                                        env=env, cwd=cwd, start_new_session=True)
        os.close(slave)
        self.master, self.output = master, bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:  # a full terminal would block the writer
        with contextlib.suppress(OSError):
            while chunk := os.read(self.master, 65536):
                self.output.extend(chunk)

    def ctrl_c(self) -> float:
        """Send Ctrl-C; the seconds until the job ended."""
        sent = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        ended = time.monotonic() - sent
        self.reader.join(timeout=5)
        os.close(self.master)
        return ended

    def text(self) -> str:
        return self.output.decode(errors="replace")


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def test_ctrl_c_ends_a_simulation_within_seconds_and_leaves_no_process(tmp_path):
    env, mark = _marked_env()
    out = tmp_path / "run"
    terminal = Terminal([*DPCFL, "simulate", "--out", str(out),
                         *_settings(**{"num-server-rounds": 500, "eval-every": 250})],
                        env, tmp_path)
    progress = out / "progress.jsonl"
    _wait_until(lambda: progress.exists() and '"round": 2,' in progress.read_text(), 240,
                "second round")
    assert len(_marked(mark)) > 2  # the command, Ray's GCS, raylet and workers
    seconds = terminal.ctrl_c()
    shown = terminal.text()
    assert terminal.process.returncode == 130, shown[-2000:]
    assert seconds < ENDS_WITHIN, shown[-2000:]
    assert "the run was stopped (Ctrl-C)" in shown
    assert "Traceback" not in shown and "RayActorError" not in shown
    assert not _left_after(mark)
    print(f"\nCtrl-C ended the simulation in {seconds:.1f} s")


def _client(port: int, runtime_port: int, ledger: Path) -> list[str]:
    return [*DPCFL, "client", "--name", "silo-00", "--superlink", f"127.0.0.1:{port}",
            "--insecure", "--partition-id", "0", "--epsilon", "10", "--delta", "1e-4",
            "--ledger-path", str(ledger), "--runtime-port", str(runtime_port)]


def test_ctrl_c_ends_a_silo_without_a_superlink_within_seconds(tmp_path):
    env, mark = _marked_env()
    terminal = Terminal(_client(free_port(), free_port(), tmp_path / "ledger.json"), env,
                        tmp_path)
    _wait_until(lambda: "Connection attempt failed" in terminal.text(), 120,
                "connection attempt")
    seconds = terminal.ctrl_c()
    assert seconds < ENDS_WITHIN, terminal.text()[-2000:]
    assert "Traceback" not in terminal.text()
    assert not _left_after(mark)


@pytest.fixture()
def superlink(tmp_path):
    """An insecure SuperLink for one test (``dpcfl server``): its fleet and control ports."""
    env, mark = _marked_env()
    env["FLWR_HOME"] = str(tmp_path / "flwr")
    fleet, control = free_port(), free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([*DPCFL, "server", "--insecure", "--in-memory",
                               "--fleet-address", f"127.0.0.1:{fleet}", "--api-address",
                               f"127.0.0.1:{control}", "--state", str(tmp_path / "state")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                              start_new_session=True)
    _wait_until(lambda: "ready:" in (tmp_path / "server.log").read_text(), 120,
                "ready SuperLink")
    yield fleet, control
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    _left_after(mark, grace=10)


def test_ctrl_c_ends_a_connected_silo_within_seconds(tmp_path, superlink):
    env, mark = _marked_env()
    terminal = Terminal(_client(superlink[0], free_port(), tmp_path / "ledger.json"), env,
                        tmp_path)
    _wait_until(lambda: "SuperNode ID" in terminal.text(), 120, "connected SuperNode")
    assert len(_marked(mark)) >= 2  # the supervisor and its SuperNode
    seconds = terminal.ctrl_c()
    assert seconds < ENDS_WITHIN, terminal.text()[-2000:]
    assert "Traceback" not in terminal.text()
    assert not _left_after(mark)
    print(f"\nCtrl-C ended the connected silo in {seconds:.1f} s")


#: What a silo's supervisor may hold resident (MiB): about 23 here, once it has replaced itself
#: with the lean supervisor (deploy/silo_supervisor.py); about 77 while it kept the settings,
#: numpy and the console its checks loaded, about 500 when it imported torch and checked the
#: silo's records itself.
SUPERVISOR_RSS_MIB = 45


def _holds_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's shared libraries mapped (it imported torch)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "/torch/lib/" in maps


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def _supernodes(supervisor: int) -> list[int]:
    found = []
    for pid in descendants(supervisor):
        with contextlib.suppress(OSError):
            if b"supernode_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def test_a_connected_silos_supervisor_never_imports_torch(tmp_path, superlink):
    # `dpcfl client` checks the silo's records with torch in a child that exits; its
    # SuperNode (the warm ClientApp) loads torch, the supervisor must not (~300 MB per silo)
    env, mark = _marked_env()
    terminal = Terminal(_client(superlink[0], free_port(), tmp_path / "ledger.json"), env,
                        tmp_path)
    try:
        _wait_until(lambda: "SuperNode ID" in terminal.text(), 240, "connected SuperNode")
        supervisor = terminal.process.pid
        _wait_until(lambda: any(_holds_torch(pid) for pid in _supernodes(supervisor)), 240,
                    "SuperNode with torch loaded")  # what the check below would see
        assert terminal.process.poll() is None, terminal.text()[-2000:]
        assert not _holds_torch(supervisor), "the silo's supervisor imported torch"
        rss = _rss_mib(supervisor)
        assert rss < SUPERVISOR_RSS_MIB, f"the silo's supervisor holds {rss:.0f} MiB"
    finally:
        terminal.ctrl_c()
    assert "Traceback" not in terminal.text()
    assert not _left_after(mark)
    print(f"\nsupervisor of a connected silo: {rss:.0f} MiB resident, no torch")


def test_ctrl_c_ends_a_submit_within_seconds_and_says_the_run_may_go_on(tmp_path, request):
    # (pyproject declares every run-config key: tests/test_examples.py)
    superlink = request.getfixturevalue("superlink")
    env, mark = _marked_env()
    env["FLWR_HOME"] = str(tmp_path / "submit-home")
    terminal = Terminal([*DPCFL, "submit", "--superlink", f"127.0.0.1:{superlink[1]}",
                         "--insecure", "--app", str(REPO), "--set",
                         f'out-dir="{tmp_path / "run"}"'], env, tmp_path)
    _wait_until(lambda: "Starting logstream" in terminal.text(), 120, "log stream")
    seconds = terminal.ctrl_c()
    shown = terminal.text()
    assert terminal.process.returncode == 130, shown[-2000:]
    run_id = re.search(r"Successfully started run (\d+)", shown).group(1)
    assert seconds < ENDS_WITHIN, shown[-2000:]
    assert f"stopped following run {run_id}; it goes on on the SuperLink" in shown
    assert f"flwr log {run_id} dpcfl-submit` follows it" in shown
    assert f"flwr stop {run_id} dpcfl-submit` stops it" in shown
    assert "Traceback" not in shown
    assert not _left_after(mark)


@pytest.mark.slow
def test_a_submitted_run_that_fails_ends_submit_with_its_error_line(tmp_path, superlink):
    """`flwr run --stream` exits 0 whatever becomes of the run; `dpcfl submit` asks the
    SuperLink how it ended and exits 1 with the ServerApp's own error line last."""
    env, mark = _marked_env()
    env["FLWR_HOME"] = str(tmp_path / "submit-home")
    started = time.monotonic()
    run = subprocess.run([*DPCFL, "submit", "--superlink", f"127.0.0.1:{superlink[1]}",
                          "--insecure", "--app", str(REPO), *_settings(**{
                              "method": '"global"', "wait-for-clients": 1,
                              "out-dir": f'"{tmp_path / "run"}"'})],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    elapsed = time.monotonic() - started
    run_id = re.search(r"Successfully started run (\d+)", run.stdout).group(1)
    # No silo connected: the ServerApp stops before round 1 (TooFewSilos, Flower's exit 201).
    assert "ServerApp raised an exception" in run.stdout  # the log stream went through
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr
    last = [line for line in run.stderr.splitlines() if line.strip()][-1]
    assert last == (f"error: run {run_id} failed: 0 of {SILOS} silos can run ({SILOS} did "
                    "not connect within 1 s); at least 1 needed"), run.stderr
    assert not _left_after(mark)
    print(f"\nfailed run: dpcfl submit exit {run.returncode} after {elapsed:.1f} s")


def test_a_stop_request_outlives_only_an_engine_failure():
    """After a run the ServerApp ended, nothing is left to stop a later run or strategy in
    this process; after a failure of the engine itself, a ServerApp thread still running is
    asked to stop (the interpreter would wait for it)."""
    from dpcfl_flwr.runs.simulation import _server_app_ends
    from dpcfl_flwr.strategies import TooFewSilos
    from dpcfl_flwr.strategies.exchange import stop_requested

    try:
        for raised, left_set in ((None, False), (TooFewSilos("0 of 3"), False),
                                 (RuntimeError("Simulation Runtime crashed."), True),
                                 (KeyboardInterrupt(), True)):
            stop_requested.set()
            with contextlib.suppress(Exception, KeyboardInterrupt), _server_app_ends():
                if raised is not None:
                    raise raised
            assert stop_requested.is_set() == left_set, raised
    finally:
        stop_requested.clear()


def test_ray_leaves_the_sigterm_handler_to_the_simulation():
    import ray._private.utils as ray_utils

    from dpcfl_flwr.flower_compat.engine import signals_left_to_us

    ours = signal.getsignal(signal.SIGTERM)
    with signals_left_to_us():
        ray_utils.set_sigterm_handler(lambda *_: None)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is ours
    assert ray_utils.set_sigterm_handler.__module__ == "ray._private.utils"


@pytest.mark.slow
def test_a_submitted_run_that_completes_ends_submit_with_exit_0(tmp_path):
    """The README's deployment (TLS, node keys, `dpcfl client` per silo) with three small
    silos: `dpcfl submit` follows the run to its end and says it completed."""
    deployment = LocalDeployment(tmp_path / "deployment", clusters="1,2")
    deployment.up("--in-memory")
    deployment.use_snapshot(REPO)  # one app for the silos and the FAB
    try:
        for index in range(SILOS):
            deployment.silo(index, "--samples-per-client", "64", "--test-samples", "40")
        run = subprocess.run([*DPCFL, "submit", "--superlink",
                              f"127.0.0.1:{deployment.api}", "--root-certificates",
                              "certs/ca.crt", "--app", str(deployment.root), *_settings(**{
                                  "method": '"global"', "num-server-rounds": 2,
                                  "eval-every": 2, "wait-for-clients": 120,
                                  "out-dir": f'"{deployment.root / "run"}"'})],
                             cwd=deployment.root, env=deployment.env, capture_output=True,
                             text=True, timeout=600)
    finally:
        deployment.down()
    run_id = re.search(r"Successfully started run (\d+)", run.stdout).group(1)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr
    assert run.stdout.rstrip().endswith(f"run {run_id} completed")
    assert "error" not in run.stderr.lower()
