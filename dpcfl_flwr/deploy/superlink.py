"""The SuperLink side of a deployment: its command, its Flower connection, node registration.

``dpcfl server`` starts ``flower-superlink`` (through :mod:`.superlink_launcher`, which lets
its Fleet API hold an idle silo's poll until work arrives) with TLS and node authentication
unless told ``--insecure``, writes the connection that ``flwr run . <name>`` uses into the Flower
configuration (``$FLWR_HOME/config.toml``), registers the silos' public keys, and then stays
in the foreground with the SuperLink.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

from .silo_file import _check_certificate, flower_tool
from .superlink_launcher import DEFAULT_PULL_HOLD


@dataclass
class ServerSettings:
    certs: Path | None = None  # holds ca.crt, server.pem, server.key (from `dpcfl certs`)
    insecure: bool = False
    node_auth: bool = True
    fleet_address: str = "0.0.0.0:9092"  # gRPC Fleet API, what silos dial
    api_address: str = "127.0.0.1:8000"  # HTTP control/runtime API, what `flwr run` dials
    state: Path = Path("state")
    connection: str = "dpcfl"
    flwr_home: Path = field(default_factory=lambda: Path(
        os.environ.get("FLWR_HOME", Path.home() / ".flwr")))
    register: list[Path] = field(default_factory=list)
    # Flower's in-memory state: nothing survives a SuperLink restart, but no SQLite file whose
    # 5 s busy timeout a CPU-starved SuperLink can overrun ("database is locked").
    in_memory: bool = False
    # Seconds the Fleet API may hold a SuperNode's empty poll until work for it arrives
    # (:mod:`.superlink_launcher`); 0 answers at once, as Flower does.
    pull_hold: float = DEFAULT_PULL_HOLD

    @property
    def database(self) -> str:
        return FLWR_IN_MEMORY_DB_NAME if self.in_memory else str(self.state / "state.db")

    @property
    def ca(self) -> Path | None:
        return None if self.certs is None else self.certs / "ca.crt"


def check_server(s: ServerSettings) -> list[str]:
    problems = []
    if s.insecure and s.node_auth:
        problems.append("node authentication requires TLS: drop --insecure or add --no-node-auth")
    if not s.insecure:
        if s.certs is None:
            problems.append("TLS needs --certs DIR (make one with `dpcfl certs`); pass "
                            "--insecure only for local experiments")
        else:
            for name in ("ca.crt", "server.pem", "server.key"):
                if not (s.certs / name).is_file():
                    problems.append(f"{s.certs / name} is missing")
            if (s.certs / "ca.crt").is_file():
                problems += _check_certificate(s.certs / "ca.crt")
    for address in (s.fleet_address, s.api_address):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"{address!r} is not host:port")
    if s.pull_hold < 0:
        problems.append(f"--pull-hold must be 0 or more seconds, got {s.pull_hold:g}")
    for key in s.register:
        if not key.is_file():
            problems.append(f"public key {key} does not exist")
    if flower_tool("flower-superlink") is None:
        problems.append("flower-superlink is not on PATH (install flwr==1.39.0)")
    return problems


def superlink_command(s: ServerSettings) -> list[str]:
    host, _, port = s.api_address.rpartition(":")
    command = [sys.executable, "-m", "dpcfl_flwr.deploy.superlink_launcher",
               "--pull-hold", f"{s.pull_hold:g}", "--fleet-api-type", "grpc-rere",
               "--fleet-api-address", s.fleet_address, "--host", host, "--port", port,
               "--isolation", "subprocess", "--database", s.database,
               "--disable-runtime-dependency-installation"]
    if s.insecure:
        command.append("--insecure")
    else:
        assert s.certs is not None
        command += ["--ssl-ca-certfile", str(s.certs / "ca.crt"),
                    "--ssl-certfile", str(s.certs / "server.pem"),
                    "--ssl-keyfile", str(s.certs / "server.key")]
    if s.node_auth:
        command.append("--enable-supernode-auth")
    return command


def connection_address(s: ServerSettings) -> str:
    host, _, port = s.api_address.rpartition(":")
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def write_connection(s: ServerSettings, root_certificates: Path | None = None) -> Path:
    """Add ``[superlink.<connection>]`` to the Flower configuration (other entries kept)."""
    path = s.flwr_home / "config.toml"
    data = tomllib.loads(path.read_text()) if path.exists() else {}
    links = data.setdefault("superlink", {})
    entry: dict[str, object] = {"address": connection_address(s)}
    if s.insecure:
        entry["insecure"] = True
    else:
        ca = root_certificates or s.ca
        entry["root-certificates"] = str(ca.resolve()) if ca else ""
    links[s.connection] = entry
    links.setdefault("default", s.connection)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))
    return path


def wait_until_listening(address: str, timeout: float) -> bool:
    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return True
        except OSError:
            time.sleep(0.3)
    return False


def register_keys(s: ServerSettings, keys: list[Path]) -> list[str]:
    """Register silo public keys with the SuperLink; returns failure messages."""
    env = {**os.environ, "FLWR_HOME": str(s.flwr_home)}
    failures = []
    for key in keys:
        done = subprocess.run([flower_tool("flwr") or "flwr", "supernode", "register",
                               str(key), s.connection,
                               "--name", key.stem], capture_output=True, text=True, env=env,
                              check=False, timeout=120)
        if done.returncode != 0:
            failures.append(f"{key}: {(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    return failures
