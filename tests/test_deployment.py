"""Real silos on 127.0.0.1: one SuperLink and four SuperNodes as separate processes, with TLS
and node authentication, driven by `flwr run` exactly as on real machines.

Covers: a complete run; a silo killed in the middle of a round (the run goes on and the results
name it) that restarts, rejoins and continues its ledger; a silo whose budget is spent refusing
to train; a SuperNode with a certificate from another CA and one with an unregistered key being
refused. The compose file is validated with Debian's docker-compose.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcfl_flwr.data import Topology
from dpcfl_flwr.deploy.compose import ComposeOptions, compose_yaml, silo_files
from dpcfl_flwr.privacy import GaussianSteps, PrivacyBudget, PrivacyLedger

REPO = Path(__file__).resolve().parents[1]
DPCFL = [str(Path(sys.executable).parent / "dpcfl")]
FLWR = str(Path(sys.executable).parent / "flwr")
SILOS = 4


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Deployment:
    """A SuperLink and silos started as the README tells operators to start them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fleet, self.api = _free_port(), _free_port()
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
        self.processes: dict[str, subprocess.Popen] = {}

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*DPCFL, *args], cwd=self.root, env=self.env, text=True,
                              capture_output=True, timeout=timeout, check=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("w")
        process = subprocess.Popen([*DPCFL, *args], cwd=self.root, env=self.env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL the silo's whole process group: no goodbye to the SuperLink."""
        process = self.processes.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def up(self) -> None:
        self.run("certs", "--out", "certs", "--san", "127.0.0.1", "--san", "localhost",
                 "--nodes", str(SILOS + 1))
        self.run("topology", "silos", "--clusters", "2,2", "--out", "clients",
                 "--superlink", f"127.0.0.1:{self.fleet}",
                 "--runtime-port-base", str(_free_port()))
        keys = [arg for i in range(SILOS) for arg in ("--register",
                                                      f"certs/nodes/silo-{i:02d}.pub")]
        self.start("server", "server", "--certs", "certs", "--fleet-address",
                   f"127.0.0.1:{self.fleet}", "--api-address", f"127.0.0.1:{self.api}",
                   "--state", "state", "--ready-file", "state/ready", *keys)
        deadline = time.monotonic() + 120
        while not (self.root / "state" / "ready").exists():
            assert self.processes["server"].poll() is None, self.log("server")
            assert time.monotonic() < deadline, self.log("server")
            time.sleep(0.5)

    def silo(self, index: int, *extra: str) -> subprocess.Popen:
        return self.start(f"silo-{index:02d}", "client", f"clients/silo-{index:02d}.toml",
                          *extra)

    def flwr_run(self, out: str, **config: object) -> subprocess.Popen:
        values = {"clusters": '"2,2"', "n-clusters": 2, "samples-per-client": 64,
                  "test-samples": 40, "min-clients": SILOS, "wait-for-clients": 180.0,
                  "out-dir": f'"{self.root / out}"', **config}
        path = self.root / f"{out}.toml"
        path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
        log = (self.root / f"{out}.log").open("w")
        return subprocess.Popen([FLWR, "run", str(REPO), "dpcfl", "--run-config", str(path),
                                 "--stream"], cwd=REPO, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def down(self) -> None:
        for name in list(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.processes[name].pid, signal.SIGKILL)
        self.processes.clear()


def _wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout} s"
        assert process.poll() is None or path.exists(), "the run ended early"
        time.sleep(1)


def _results(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("deployment"))
    dep.up()
    for i in range(SILOS):
        dep.silo(i)
    yield dep
    dep.down()


@pytest.mark.slow
def test_a_run_over_grpc_with_tls_and_node_authentication(deployment):
    started = time.monotonic()
    run = deployment.flwr_run("run-tls", **{"num-server-rounds": 3, "eval-every": 3})
    run.wait(timeout=900)
    wall = time.monotonic() - started
    results = _results(deployment.root / "run-tls")
    assert results["complete"] and len(results["clients"]) == SILOS
    assert all(c["test_accuracy"] is not None for c in results["clients"])
    assert all(c["epsilon_spent"] <= c["epsilon_budget"] for c in results["clients"])
    assert all(not c["dropped_rounds"] for c in results["clients"])
    server_log = deployment.log("server")
    assert "--enable-supernode-auth" in server_log and "--ssl-certfile" in server_log
    (deployment.root / "wall-seconds.txt").write_text(f"{wall:.1f}\n")
    print(f"\nmulti-process run over gRPC+TLS: {wall:.1f} s wall, "
          f"{results['wall_seconds']:.1f} s inside the ServerApp")


@pytest.mark.slow
def test_a_killed_silo_is_dropped_rejoins_and_keeps_its_ledger_and_a_spent_one_refuses(
        deployment):
    root = deployment.root
    # Fresh budgets for this run: every silo gets a new ledger file ...
    for i in range(SILOS):
        deployment.kill(f"silo-{i:02d}")
    time.sleep(1)
    ledgers = root / "ledgers-faults"
    # ... except silo 3, whose earlier runs already spent eps = 9.993 of 10.
    spent = PrivacyLedger([GaussianSteps(0.5249, 1.0, 1, round=1)])
    spent.save(ledgers / "silo-03.json")
    for i in range(SILOS):
        deployment.silo(i, "--ledger-path", str(ledgers / f"silo-{i:02d}.json"))
    run = deployment.flwr_run("run-faults", **{"num-server-rounds": 7, "eval-every": 7,
                                               "round-timeout": 40.0})
    progress = root / "run-faults" / "progress.jsonl"
    _wait_for(progress, '"round": 1,', run, timeout=400)
    time.sleep(3)  # silo 1 is now inside round 2
    deployment.kill("silo-01")
    before = PrivacyLedger.load(ledgers / "silo-01.json").entries
    deployment.silo(1, "--ledger-path", str(ledgers / "silo-01.json"))  # restarts, rejoins
    run.wait(timeout=1500)
    results = _results(root / "run-faults")
    clients = {c["partition"]: c for c in results["clients"]}
    assert results["complete"]
    assert 2 in clients[1]["dropped_rounds"]  # the results say who dropped, and when
    after = PrivacyLedger.load(ledgers / "silo-01.json")
    assert after.entries[:len(before)] == before  # the restart continued the ledger
    assert max(e.round or 0 for e in after.entries) > 3  # ... and trained after rejoining
    budget = PrivacyBudget(10.0, 1e-4)
    assert after.spent(budget) <= 10.0
    assert clients[3]["refused_rounds"] == [1] and clients[3]["exhausted"]
    assert PrivacyLedger.load(ledgers / "silo-03.json").entries == spent.entries
    assert all(c["epsilon_spent"] <= c["epsilon_budget"] for c in clients.values())


@pytest.mark.slow
def test_a_foreign_certificate_and_an_unregistered_key_are_refused(deployment):
    root = deployment.root
    deployment.run("certs", "--out", "other-ca", "--san", "127.0.0.1", "--nodes", "1")
    foreign = deployment.start("foreign", "client", "clients/silo-00.toml", "--name", "foreign",
                               "--root-certificates", "other-ca/ca.crt", "--runtime-port",
                               str(_free_port()), "--ledger-path", "foreign.json",
                               "--rejoin-wait", "0")
    rogue = deployment.start("rogue", "client", "clients/silo-00.toml", "--name", "rogue",
                             "--auth-private-key", "certs/nodes/silo-04", "--runtime-port",
                             str(_free_port()), "--ledger-path", "rogue.json",
                             "--rejoin-wait", "0")
    assert foreign.wait(timeout=180) != 0
    assert rogue.wait(timeout=180) != 0
    assert "SSL/TLS handshake error" in deployment.log("foreign")
    assert "Failed to activate SuperNode" in deployment.log("rogue")
    assert not (root / "foreign.json").exists() and not (root / "rogue.json").exists()


def test_committed_compose_file_and_silo_files_match_the_generator():
    options = ComposeOptions(Topology.parse("3,6,6,6"), Topology.parse("1,2,2,2"))
    assert (REPO / "compose.yaml").read_text() == compose_yaml(options)
    for name, text in silo_files(Topology.parse("3,6,6,6")).items():
        assert (REPO / "clients" / f"{name}.toml").read_text() == text


def test_docker_compose_accepts_the_compose_file():
    assert shutil.which("docker-compose"), "install Debian's docker-compose (scripts/setup.sh does)"
    for profile in ("cpu", "gpu", "laptop"):
        checked = subprocess.run(["docker-compose", "--profile", profile, "config", "-q"],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stderr
