"""The SuperLink side of a deployment: its command, its Flower connection, node registration.

``dpcfl server`` starts ``flower-superlink`` (through :mod:`.superlink_launcher`, which lets
its Fleet API hold an idle silo's poll until work arrives) with TLS and node authentication
unless told ``--insecure``, writes the connection that ``flwr run . <name>`` uses into the Flower
configuration (``$FLWR_HOME/config.toml``), registers the silos' public keys, and then stays
in the foreground with the SuperLink.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import tomli_w
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..flower_compat import IN_MEMORY_DATABASE, register_node_keys
from ..flower_compat.environment import flower_tool
from ..flower_compat.transport import superlink_fleet_flags
from .certs import certificate_problems, server_certificate_problems
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
        return IN_MEMORY_DATABASE if self.in_memory else str(self.state / "state.db")

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
                problems += certificate_problems(s.certs / "ca.crt")
            if not problems:
                # key registration and Flower's SuperExec dial the control API over TLS
                problems += server_certificate_problems(
                    s.certs, [connection_address(s).rpartition(":")[0]])
    for address in (s.fleet_address, s.api_address):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"{address!r} is not host:port")
    if s.pull_hold < 0:
        problems.append(f"--pull-hold must be 0 or more seconds, got {s.pull_hold:g}")
    for key in s.register:
        if not key.is_file():
            problems.append(f"public key {key} does not exist")
            continue
        try:
            public = serialization.load_ssh_public_key(key.read_bytes())
        except (ValueError, UnsupportedAlgorithm):
            public = None
        if not isinstance(public, ec.EllipticCurvePublicKey):
            problems.append(f"{key} is not an OpenSSH elliptic-curve public key (the .pub "
                            "files of `dpcfl certs` are)")
    if flower_tool("flower-superlink") is None:
        problems.append("flower-superlink is not on PATH (install flwr==1.39.0)")
    return problems


def superlink_command(s: ServerSettings) -> list[str]:
    host, _, port = s.api_address.rpartition(":")
    command = [sys.executable, "-m", "dpcfl_flwr.deploy.superlink_launcher",
               "--pull-hold", f"{s.pull_hold:g}", *superlink_fleet_flags(s.fleet_address),
               "--host", host, "--port", port,
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


def listen_problems(s: ServerSettings) -> list[str]:
    """One line per address the SuperLink could not listen on (a port in use names the
    process holding it when this machine says): checked before anything starts, instead of
    Flower's traceback once the SuperLink is half up."""
    problems = []
    for flag, address in (("--fleet-address", s.fleet_address), ("--api-address",
                                                                 s.api_address)):
        host, _, port = address.rpartition(":")
        if host and port.isdigit() and (problem := _bind_problem(host.strip("[]"), int(port))):
            problems.append(f"{flag} {address}: {problem}")
    return problems


def _bind_problem(host: str, port: int) -> str | None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror})"
    with socket.socket(family, kind, proto) as probe:
        # SO_REUSEADDR: a closed SuperLink's connections in TIME_WAIT do not hold the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"cannot listen there ({exc.strerror})"
            holder = _listening_process(port)
            return (f"port {port} is already in use{f' by {holder}' if holder else ''}; stop "
                    "that process (a SuperLink left by a killed `dpcfl server`?) or choose "
                    "another port")
    return None


def _listening_process(port: int) -> str | None:
    """``pid N (command)`` of a process listening on TCP ``port``, if /proc shows one."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                sockets.add(f"socket:[{fields[9]}]")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) in sockets for fd in fd_dir.iterdir()):
                argv = (fd_dir.parent / "cmdline").read_bytes().decode(errors="replace")
                program, *arguments = argv.split("\0")
                shown = " ".join([Path(program).name, *arguments[:2]])
                return f"pid {fd_dir.parent.name} ({shown})"
        except OSError:
            continue
    return None


def dial_addresses(s: ServerSettings) -> list[str]:
    """What a silo can dial to reach the Fleet API: the listening address itself, or, when it
    listens on every interface, the names in the SuperLink's certificate (with TLS a silo
    must dial one of them anyway) or this machine's name."""
    host, _, port = s.fleet_address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return [s.fleet_address]
    names = [socket.getfqdn()]
    if not s.insecure and s.certs is not None:
        try:
            pem = (s.certs / "server.pem").read_bytes()
            names = [str(n.value) for n in x509.load_pem_x509_certificate(pem).extensions
                     .get_extension_for_class(x509.SubjectAlternativeName).value]
        except (OSError, ValueError, x509.ExtensionNotFound):
            pass
    return [f"[{n}]:{port}" if _is_ipv6(n) else f"{n}:{port}" for n in names]


def _is_ipv6(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).version == 6
    except ValueError:
        return False


def wait_until_listening(address: str, timeout: float,
                         alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether ``address`` accepts connections within ``timeout`` s (False at once when
    ``alive()`` says the process that should listen there has ended)."""
    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return True
        except OSError:
            time.sleep(0.3)
    return False


#: Flower's error code for a public key that a node already has: registering it again
#: changes nothing, so for a restarted SuperLink (its state kept) it is not a failure.
PUBLIC_KEY_ALREADY_IN_USE = 23


@dataclass
class Registration:
    registered: list[Path] = field(default_factory=list)
    already: list[Path] = field(default_factory=list)  # registered before (kept state)
    failures: list[str] = field(default_factory=list)  # one line each, for people


def register_keys(s: ServerSettings, keys: list[Path]) -> Registration:
    """Register silo public keys with the SuperLink; a key registered before is left as it
    is. One client in this process makes every request (:func:`register_node_keys`); with
    Flower's tuning gate closed, ``flwr supernode register`` runs once per key instead, a few
    at a time (each a Python process, ~0.7 s of CPU)."""
    answers = register_node_keys(s.flwr_home, s.connection, keys)
    if answers is None:
        with ThreadPoolExecutor(max_workers=REGISTERING_AT_ONCE) as pool:
            answers = list(pool.map(partial(_register_by_command, s), keys))
    result = Registration()
    for key, (registered, refusal) in zip(keys, answers, strict=True):
        if registered:
            result.registered.append(key)
        elif f"[code: {PUBLIC_KEY_ALREADY_IN_USE}]" in str(refusal):
            result.already.append(key)
        else:
            result.failures.append(f"could not register {key}: {_one_line(refusal)}")
    return result


#: ``flwr supernode register`` processes at a time (21 keys: 38 s one by one on 2 busy cores).
REGISTERING_AT_ONCE = 4
#: Seconds one ``flwr supernode register`` may take: on 2 cores at load average 30-40 (docker
#: compose beside other jobs) registering 21 keys took 6-8 minutes. The timeout (120 s before)
#: was not caught and ended ``dpcfl server`` with a traceback; now it is one line.
REGISTER_TIMEOUT = 600.0


def _register_by_command(s: ServerSettings, key: Path) -> tuple[bool, str | None]:
    """(registered, the refusal) from Flower's public command."""
    try:
        done = subprocess.run([flower_tool("flwr") or "flwr", "supernode", "register",
                               str(key), s.connection, "--name", key.stem, "--format", "json"],
                              capture_output=True, text=True, check=False,
                              timeout=REGISTER_TIMEOUT,
                              env={**os.environ, "FLWR_HOME": str(s.flwr_home)})
    except subprocess.TimeoutExpired:
        return False, (f"`flwr supernode register` did not answer within "
                       f"{REGISTER_TIMEOUT:.0f} s (is the machine overloaded?)")
    answer = _json_answer(done.stdout)
    if answer.get("success") is True:
        return True, None
    return False, str(answer.get("error-message") or done.stderr or done.stdout
                      or f"flwr exited with {done.returncode}")


def _one_line(refusal: str | None) -> str:
    """Flower's refusal as one line: no colours, log prefix, exit code, box drawing, nor the
    connection line and link that open and close its messages."""
    reason = re.sub(r"\x1b\[[0-9;]*m", "", str(refusal or "no reason given"))
    reason = re.sub(r"ERROR\s*:|Exit Code: \d+", "", reason)
    lines = [line.strip(" │╭╮╰╯─") for line in reason.splitlines()]
    lines = [line for line in lines if line and not line.startswith(
        ("Using SuperLink", "For more information"))]
    return " ".join(lines) or "no reason given"


def _json_answer(output: str) -> dict[str, object]:
    """The JSON object that ``flwr ... --format json`` prints (after any other output)."""
    start = output.find("{")
    try:
        answer = json.loads(output[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}
