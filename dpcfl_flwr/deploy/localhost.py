"""A whole deployment on one machine: SuperLink and silos as separate local processes.

What an operator would start on several machines (``dpcfl server``, ``dpcfl client``, ``flwr
run``), started on 127.0.0.1 with TLS and node authentication; used by the deployment tests
and the gRPC benchmarks, and handy to try a deployment before spreading it over machines.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..runs.processes import descendants

#: The environment whose ``dpcfl`` and ``flwr`` a deployment runs unless told another: this one.
BIN_DIR = Path(sys.executable).parent
DPCFL = [str(BIN_DIR / "dpcfl")]
FLWR = str(BIN_DIR / "flwr")


#: Ports :func:`free_port` draws from end where the kernel's ephemeral range begins.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORT_SPAN = 12000  # how many ports below that range it draws from


#: Every port :func:`free_port` has handed out in this process: it never hands one out twice.
_GIVEN: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports nothing is bound to on 127.0.0.1 now, for
    servers started next, none of them handed out before by this process.

    Drawn at random below the kernel's ephemeral range, where it can be: the kernel gives
    ports of that range to outgoing connections as their source ports, so a port it handed
    out there could be taken by another process's connection before the server binds it (a
    silo whose runtime port was taken so would not start). Where the range leaves no room
    below it, the kernel picks the first. A port handed out is not bound until its server
    starts, so a probe alone would hand it out again: a SuperLink's Fleet port drawn inside
    the block of its silos' runtime ports left one silo unable to start."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    try:
        floor = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        floor = 0
    draw = random.SystemRandom()
    for _ in range(100 if floor - FREE_PORT_SPAN >= 1024 else 0):
        first = draw.randrange(floor - FREE_PORT_SPAN, floor - count + 1)
        if _claim(first, count):
            return first
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if _claim(first, count):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _claim(first: int, count: int) -> bool:
    """Whether ports first .. first + count - 1 are all unbound and never handed out; if so,
    they are handed out now."""
    ports = range(first, first + count)
    if ports.stop > 65536 or any(port in _GIVEN for port in ports):
        return False
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    _GIVEN.update(ports)
    return True


#: The run-config keys that fix a silo's records and reports, and the silo flag of each.
SILO_KEYS = {"dataset": "--dataset", "shift": "--shift", "samples-per-client":
             "--samples-per-client", "val-fraction": "--val-fraction", "test-samples":
             "--test-samples", "data-draw": "--data-draw", "seed": "--data-seed",
             "metrics": "--metrics", "metrics-noise": "--metrics-noise"}


def silo_flags(run_config: Mapping[str, Any]) -> list[str]:
    """``dpcfl client`` flags that give a silo the records and metrics policy ``run_config``
    gives it in simulation: a deployed silo never takes them from the run config, so a local
    deployment measured against a simulation must hand them to its silos."""
    return [arg for key, flag in SILO_KEYS.items() if key in run_config
            for arg in (flag, str(run_config[key]))]


class LocalDeployment:
    """A SuperLink and ``silos`` silos of topology ``clusters``, as the README starts them.

    ``bin_dir``: the ``bin`` directory of the environment every process runs from (its
    ``dpcfl`` and ``flwr``; they start Flower's commands from the same directory), a silo
    operator's virtual environment say; by default the environment running this Python.
    """

    def __init__(self, root: Path, clusters: str = "2,2", bin_dir: Path | None = None) -> None:
        self.root = root
        self.bin_dir = bin_dir or BIN_DIR
        self.clusters = clusters
        self.silos = sum(int(c) for c in clusters.split(","))
        self.runtime_ports = free_port(self.silos)  # silo i listens on this + i
        self.fleet, self.api = free_port(), free_port()
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
        self.processes: dict[str, subprocess.Popen] = {}
        self._server: list[str] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin_dir / "dpcfl"), *args], cwd=self.root,
                              env=self.env, text=True, capture_output=True, timeout=timeout,
                              check=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("w")
        process = subprocess.Popen([str(self.bin_dir / "dpcfl"), *args], cwd=self.root,
                                   env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def last_line(self, name: str) -> str:
        """The last non-blank line of ``name``'s log (its error, when it failed)."""
        lines = [line for line in self.log(name).splitlines() if line.strip()]
        return lines[-1] if lines else "no output"

    def kill(self, name: str) -> None:
        """SIGKILL the silo and everything it started: no goodbye to the SuperLink."""
        _kill_all([self.processes.pop(name)])

    def stop(self, name: str, timeout: float = 30) -> None:
        """Stop the silo as an operator would (SIGTERM, its SuperNode leaves the SuperLink);
        whatever is left after ``timeout`` s is killed."""
        process = self.processes.pop(name)
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        _kill_all([process])

    def up(self, *server_options: str) -> None:
        """Certificates (one spare, unregistered node key), silo files, the SuperLink."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.run("certs", "--out", "certs", "--san", "127.0.0.1", "--san", "localhost",
                 "--nodes", str(self.silos + 1))
        self.run("topology", "silos", "--clusters", self.clusters, "--out", "clients",
                 "--superlink", f"127.0.0.1:{self.fleet}",
                 "--runtime-port-base", str(self.runtime_ports))
        keys = [arg for i in range(self.silos) for arg in ("--register",
                                                           f"certs/nodes/silo-{i:02d}.pub")]
        self._server = ["server", "--certs", "certs", "--fleet-address",
                        f"127.0.0.1:{self.fleet}", "--api-address", f"127.0.0.1:{self.api}",
                        "--state", "state", "--ready-file", "state/ready", *server_options,
                        *keys]
        self.start("server", *self._server)
        self.wait_ready()

    def use_snapshot(self, repo: Path) -> Path:
        """Copy ``repo``'s app (the package and pyproject.toml: what `flwr run` packs) into
        the deployment's root and put it first on every process's path: the silos and the FAB
        then carry one snapshot (a silo refuses a FAB with other code), whatever happens to
        the checkout meanwhile. Returns the app directory."""
        shutil.copytree(repo / "dpcfl_flwr", self.root / "dpcfl_flwr",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(repo / "pyproject.toml", self.root / "pyproject.toml")
        self.env["PYTHONPATH"] = str(self.root)
        return self.root

    def restart_server(self) -> None:
        """Start the SuperLink again as :meth:`up` did (after :meth:`kill` of "server")."""
        (self.root / "state" / "ready").unlink(missing_ok=True)
        self.start("server", *self._server)
        self.wait_ready()

    def silo(self, index: int, *extra: str) -> subprocess.Popen:
        return self.start(f"silo-{index:02d}", "client", f"clients/silo-{index:02d}.toml",
                          *extra)

    def flwr_run(self, out: str, app: Path, **config: object) -> subprocess.Popen:
        """``flwr run <app> dpcfl`` with run-config values (TOML-formatted) over the defaults."""
        values = {"clusters": f'"{self.clusters}"', "min-clients": self.silos,
                  "wait-for-clients": 300.0, "out-dir": f'"{self.root / out}"', **config}
        path = self.root / f"{out}.toml"
        path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
        log = (self.root / f"{out}.log").open("w")
        return subprocess.Popen([str(self.bin_dir / "flwr"), "run", str(app), "dpcfl",
                                 "--run-config", str(path), "--stream"], cwd=app,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_run(self, run: subprocess.Popen, timeout: float) -> int:
        """The exit status of ``run`` (a ``flwr run`` of this deployment), waiting at most
        ``timeout`` s (then ``subprocess.TimeoutExpired``). Raises RuntimeError as soon as a
        silo's process ends before the run does, with the silo's name and the last line of
        its log: a silo that could not start would otherwise keep the run waiting for it
        until the run's wait-for-clients ran out (minutes), to end with "too few silos"."""
        deadline = time.monotonic() + timeout
        while (code := run.poll()) is None:
            for name, process in self.processes.items():
                if name.startswith("silo-") and process.poll() is not None:
                    raise RuntimeError(f"{name} ended (exit {process.returncode}) before the "
                                       f"run: {self.last_line(name)}")
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(run.args, timeout)
            time.sleep(0.5)
        return code

    def down(self) -> None:
        _kill_all(list(self.processes.values()))
        self.processes.clear()

    def wait_ready(self, server: str = "server", timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (self.root / "state" / "ready").exists():
            if self.processes[server].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the SuperLink did not come up:\n{self.log(server)}")
            time.sleep(0.5)


def _kill_all(processes: list[subprocess.Popen]) -> None:
    """SIGKILL these processes and every process below them. A silo's SuperNode and ClientApp
    runtime run in sessions of their own (their supervisor stops them as a group), so killing
    the supervisor's group alone would leave them to their parent-death signal: a graceful
    exit that says goodbye to the SuperLink, and a straggler if that exit stalls."""
    tree = {pid for process in processes for pid in descendants(process.pid)}
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for process in processes:
        process.wait()
