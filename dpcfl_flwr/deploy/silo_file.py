"""A silo's deployment file (``clients/<name>.toml``) and the SuperNode command it becomes.

```toml
name = "silo-00"
superlink = "superlink.example.org:9092"   # the SuperLink's Fleet API (gRPC)
root-certificates = "../certs/ca.crt"       # TLS: the CA that signed the SuperLink certificate
auth-private-key = "../certs/nodes/silo-00" # node authentication (OpenSSH EC key)
insecure = false                            # true only for local experiments, never by default
runtime-port = 9100                         # this silo's ClientApp runtime port on its host
warm = true                                 # the SuperNode answers all messages itself with
                                            # one loaded ClientApp (false: a fresh
                                            # flwr-clientapp per message); either way only for
                                            # a FAB that ships the app installed here
idle-poll = 0.5                             # seconds between SuperLink polls when idle
                                            # (Flower's own SuperNode waits 3)

[node]                                      # read by the ClientApp (config.settings.SiloConfig)
partition-id = 0
true-cluster = 0                            # evaluation only
epsilon = 10.0                              # required: the silo's budget ...
delta = 1e-4                                # ... both parts of it
# run-epsilon = 5.0                         # optional: what one run plans to spend of it
                                            # (unset: all that is left)
ledger-path = "../ledgers/silo-00.json"     # required: where its spending is recorded
dataset = "fmnist"                          # its records: never taken from the server
clusters = "3,6,6,6"
shift = "rotation"
samples-per-client = 500
val-fraction = 0.25
test-samples = 0
data-draw = "authors"
data-seed = 0
metrics = "private"                         # what it reports: noised and charged
metrics-noise = 10.0
report-cpu-seconds = false                  # timing follows the Poisson sample: opt-in only
max-candidates = 16                         # what one message may make it do (refused beyond)
max-round-steps = 10000
max-model-parameters = 50000000             # what one run config may make it build
max-classes = 10000
max-physical-batch = 4096
max-round-memory = 4096                     # MiB, a round's estimated peak
threads = 1
device = "cpu"
```

``epsilon``, ``delta`` and ``ledger-path`` must be set (``dpcfl client`` refuses to start
without them, and so does the ClientApp); an unset split or reporting key takes the default
written in :class:`~dpcfl_flwr.config.settings.SiloConfig`, never the run config's. Relative
paths are relative to the file. Everything is checked before anything starts.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from pydantic import Field, ValidationError

from ..config.settings import SiloConfig, parse_node_config
from ..config.validation import ConfigError, ConfigModel, one_line_error
from ..flower_compat.environment import flower_tool
from ..flower_compat.transport import supernode_fleet_flags
from . import silo_torch
from .certs import certificate_problems
from .supernode_launcher import DEFAULT_IDLE_POLL

PATH_KEYS_NODE = ("ledger-path", "data-dir", "data-path", "schema-file")


class SiloFile(ConfigModel):
    name: str = Field(min_length=1)
    superlink: str = "127.0.0.1:9092"
    root_certificates: str = ""
    auth_private_key: str = ""
    insecure: bool = False
    runtime_host: str = "127.0.0.1"
    runtime_port: int = Field(9094, ge=1, le=65535)
    max_retries: int = Field(0, ge=0, description="0: keep reconnecting")
    warm: bool = True
    idle_poll: float = Field(DEFAULT_IDLE_POLL, gt=0.0, le=60.0)
    node: dict[str, Any] = Field(default_factory=dict)


def _resolve(base: Path, value: str) -> str:
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def load_silo_file(path: Path | None, overrides: Mapping[str, Any],
                   node_overrides: Mapping[str, Any]) -> tuple[SiloFile, SiloConfig]:
    """Read (optional) file, apply command-line overrides, resolve paths, validate."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read the silo file ({exc})") from None
        base = path.resolve().parent
    raw.update({k: v for k, v in overrides.items() if v is not None})
    raw["node"] = {**raw.get("node", {}), **node_overrides}
    for key in ("root-certificates", "auth-private-key"):
        raw[key] = _resolve(base, str(raw.get(key, "")))
    for key in PATH_KEYS_NODE:
        if raw["node"].get(key):
            raw["node"][key] = _resolve(base, str(raw["node"][key]))
    try:
        silo = SiloFile.model_validate(raw)
    except ValidationError as exc:
        raise one_line_error(exc, f"silo file {path or '(flags)'}", SiloFile) from None
    return silo, parse_node_config(silo.node)


def deployed_settings(node: SiloConfig) -> SiloConfig:
    """What the deployed ClientApp will use: ``node`` with every unset key at the code's
    default; raises :class:`ConfigError` (one line naming the missing keys) without a budget
    or ledger of the silo's own."""
    return node.resolved(None, trust_run_config=False)


def check_silo(silo: SiloFile, node: SiloConfig) -> silo_torch.SiloInspection:
    """Everything that would stop the silo, as messages for people (``problems`` empty:
    ready), and what its ledger already holds (``ledger``)."""
    problems = []
    ledger = "not measured: the silo's settings are incomplete"
    try:
        settings = deployed_settings(node)
    except ConfigError as exc:
        problems.append(str(exc))
    else:
        inspection = silo_torch.inspect_silo(settings)
        problems += inspection.problems
        ledger = inspection.ledger
    if silo.insecure and silo.root_certificates:
        problems.append("insecure = true and root-certificates are both set: choose one")
    if not silo.insecure and not silo.root_certificates:
        problems.append("TLS needs root-certificates (the CA of the SuperLink); pass "
                        "--insecure only for local experiments")
    if silo.root_certificates:
        problems += certificate_problems(Path(silo.root_certificates))
    if silo.auth_private_key:
        if silo.insecure:
            problems.append("node authentication (auth-private-key) requires TLS")
        problems += _check_node_key(Path(silo.auth_private_key))
    host, _, port = silo.superlink.rpartition(":")
    if not host or not port.isdigit():
        problems.append(f"superlink {silo.superlink!r} is not host:port")
    if not _port_free(silo.runtime_host, silo.runtime_port):
        problems.append(f"runtime port {silo.runtime_host}:{silo.runtime_port} is in use "
                        "(every silo on a host needs its own runtime-port)")
    if node.ledger_path and not _writable_dir(Path(node.ledger_path).parent):
        problems.append(f"ledger directory {Path(node.ledger_path).parent} is not writable")
    if node.data_dir and not Path(node.data_dir).is_dir():
        problems.append(f"data-dir {node.data_dir} does not exist")
    if flower_tool("flower-supernode") is None:
        problems.append("flower-supernode is not on PATH (install flwr==1.39.0)")
    return silo_torch.SiloInspection(problems, ledger)


def _check_node_key(path: Path) -> list[str]:
    try:
        load_ssh_private_key(path.read_bytes(), None)
    except OSError as exc:
        return [f"auth-private-key {path}: {exc.strerror or exc}"]
    except (ValueError, TypeError):
        return [f"auth-private-key {path}: not an OpenSSH private key (make one with "
                "`dpcfl certs`)"]
    return []


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _writable_dir(path: Path) -> bool:
    """Silos sharing a ledger directory start at once: each probes with its own file."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError:
        return False
    return True


def node_config_text(node: SiloConfig) -> str:
    """The ``--node-config`` string: the silo's settings, TOML-valued."""
    values = node.model_dump(by_alias=True, exclude_defaults=True)
    values.setdefault("partition-id", node.partition_id)
    parts = []
    for key, value in values.items():
        if value is None:
            continue
        text = f'"{value}"' if isinstance(value, str) else (
            str(value).lower() if isinstance(value, bool) else repr(value))
        parts.append(f"{key}={text}")
    return " ".join(parts)


def supernode_command(silo: SiloFile, node: SiloConfig) -> list[str]:
    """The ``flower-supernode`` command line of this silo (gRPC Fleet API, flwr 1.39), run
    through :mod:`.supernode_launcher` so that an idle silo polls every ``idle-poll`` seconds.

    The SuperNode starts no SuperExec of its own (``--isolation process``): it answers its
    ClientApp tasks itself, warm or with one ``flwr-clientapp`` per message, and only for FABs
    that ship the app installed here (:mod:`dpcfl_flwr.app_pin`,
    :mod:`dpcfl_flwr.flower_compat.direct_runtime`). It imports
    that app as this process did (``-P``: not from the working directory), so the plan names
    the code the silo runs.
    """
    command = [sys.executable, "-P", "-m", "dpcfl_flwr.deploy.supernode_launcher",
               "--clientapp", "warm" if silo.warm else "per-message",
               "--idle-poll", f"{silo.idle_poll:g}", *supernode_fleet_flags(silo.superlink),
               "--host", silo.runtime_host, "--port", str(silo.runtime_port),
               "--isolation", "process", "--node-config", node_config_text(node)]
    if silo.insecure:
        command.append("--insecure")
    else:
        command += ["--root-certificates", silo.root_certificates]
    if silo.auth_private_key:
        command += ["--auth-supernode-private-key", silo.auth_private_key]
    if silo.max_retries:
        command += ["--max-retries", str(silo.max_retries)]
    return command
