"""``compose.yaml`` and the silo files, generated from a topology (so they cannot drift).

Services (one image for all of them, ``docker/Dockerfile``):
- ``certs``: a one-shot container that runs ``dpcfl certs --keep`` (the CA, the SuperLink
  certificate and one node key pair per silo, made once into its own ``certs`` volume; later
  starts keep them and fix a certificate that lacks a name) and then hands each party a copy
  of what it needs, in a volume of that party's own: ``silo-NN-certs`` (``ca.crt`` and the
  silo's own key pair), ``superlink-certs`` (``ca.crt``, the SuperLink's certificate and key,
  the silos' public keys) and ``ca-cert`` (``ca.crt``, for the runner). No other container
  holds the CA key, and none but a silo's own holds its private key: a node key is a silo's
  identity to the SuperLink, and the CA key could sign a SuperLink certificate that every
  silo would trust;
- ``superlink``: ``dpcfl server`` with TLS and node authentication, which registers every
  silo's public key; its ServerApp processes write the results to ``./results/compose``;
- ``silo-NN``: ``dpcfl client`` per silo of the topology, each with its own silo file (budget,
  ledger and data split of its own), key volume and ledger volume (its budget survives
  container restarts);
- ``serverapp``: submits the run (``dpcfl submit`` = ``flwr run``) once the silos are up.

Inside every container the files keep the paths ``dpcfl certs`` gives them
(``/certs/ca.crt``, ``/certs/nodes/silo-NN``), so a container sees a subset of one layout.

Profiles: ``cpu`` (the default, set in ``.env``), ``gpu`` (each silo its own GPU, ``cuda``
torch build), ``laptop`` (a smaller topology).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from ..config.settings import ExperimentConfig, parse_run_config
from ..data import Topology

IMAGE = "dpcfl-flwr:0.1.0"
GPU_IMAGE = "dpcfl-flwr:0.1.0-cuda"
FLEET_PORT = 9092
API_PORT = 8000
#: The SuperLink's health check: made once its silo keys are registered. It lives in the kept
#: state volume, so the container removes it before anything else: a ready file left by the
#: previous start made a restarted stack "healthy" before its SuperLink listened.
READY = "/state/ready"
#: The cert maker's own volume: the CA key and everything ``dpcfl certs`` made. It keeps the
#: name of the one volume every container mounted before, so a stack made then keeps its CA
#: and node keys (its silos stay the keys its SuperLink registered) under this file.
CERTS_VOLUME = "certs"
SUPERLINK_CERTS = "superlink-certs"
CA_CERT = "ca-cert"
#: Where the cert maker mounts each party's volume: ``/deliver/<volume>``.
DELIVER = "/deliver"


@dataclass(frozen=True)
class ComposeOptions:
    topology: Topology
    laptop: Topology
    gpus: int = 4
    epsilon: float = 10.0


def silo_name(index: int) -> str:
    return f"silo-{index:02d}"


def silo_certs(index: int) -> str:
    """The volume that holds silo ``index``'s key pair and ``ca.crt``, and nothing else; its
    silo containers of every profile mount it (they are the same party to the SuperLink)."""
    return f"{silo_name(index)}-certs"


def silo_split(experiment: ExperimentConfig, topology: Topology) -> dict[str, object]:
    """A silo's node-config keys for the records ``experiment`` gives it in simulation (its
    dataset, topology and split, drawn with the run's seed), and its reporting policy: private
    metrics. Everything a deployed silo would otherwise take from the code's defaults."""
    return {"dataset": experiment.dataset, "clusters": str(topology), "shift": experiment.shift,
            "samples-per-client": experiment.samples_per_client,
            "val-fraction": experiment.val_fraction, "test-samples": experiment.test_samples,
            "data-draw": experiment.data_draw, "data-seed": experiment.seed,
            "metrics": "private", "metrics-noise": experiment.metrics_noise}


def _toml(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def silo_file_text(topology: Topology, index: int, superlink: str, runtime_port: int,
                   experiment: ExperimentConfig) -> str:
    """Silo ``index``'s file: its budget (``experiment``'s epsilon and delta), ledger and the
    split ``experiment`` would give it (:func:`silo_split`)."""
    name, cluster = silo_name(index), topology.cluster_of(index)
    minority = topology.minority_cluster()
    role = ("no minority: equal smallest clusters" if minority is None
            else "minority" if cluster == minority else "majority")
    # its own values where the run config gives silos different ones (silo-epsilons, ...)
    own = {key.replace("_", "-"): value
           for key, value in experiment.silo_overrides(index).items()}
    budget = {"epsilon": own.pop("epsilon", experiment.epsilon),
              "delta": own.pop("delta", experiment.delta)}
    split = "\n".join(f"{key} = {_toml(value)}"
                      for key, value in {**silo_split(experiment, topology), **own}.items())
    return f'''# {name}: client {index} of topology {{{topology}}}, true cluster {cluster} ({role}).
# Launch with `dpcfl client PATH-OF-THIS-FILE` (relative paths below are relative to it).
# Its budget, ledger and records are its own: the server's run config never changes them.
name = "{name}"
superlink = "{superlink}"
root-certificates = "../certs/ca.crt"
auth-private-key = "../certs/nodes/{name}"
insecure = false
runtime-port = {runtime_port}

[node]
partition-id = {index}
epsilon = {budget["epsilon"]!r}
delta = {budget["delta"]!r}
ledger-path = "../ledgers/{name}.json"
{split}
threads = 1
device = "cpu"
'''


def silo_files(topology: Topology, superlink: str = "127.0.0.1:9092",
               runtime_port_base: int = 9100,
               experiment: ExperimentConfig | None = None) -> dict[str, str]:
    """One silo file per client of ``topology``; ``experiment`` (default: the code's defaults,
    which are the quick example's) gives their budget and split."""
    experiment = experiment or parse_run_config({})
    return {silo_name(i): silo_file_text(topology, i, superlink, runtime_port_base + i,
                                         experiment)
            for i in range(topology.num_clients)}


def _list(items: list[str], indent: int) -> str:
    pad = " " * indent
    # JSON strings are valid YAML double-quoted scalars (quotes inside are escaped).
    return "\n".join(f"{pad}- {json.dumps(item)}" for item in items)


def _silo_service(index: int, profile: str, prefix: str, gpu: int | None,
                  clusters: Topology | None = None) -> str:
    """``clusters``: the topology when it is not the silo files' (the laptop profile's)."""
    name = silo_name(index)
    service = f"{prefix}{name}"
    command = ["dpcfl", "client", f"/app/clients/{name}.toml", "--superlink",
               f"superlink:{FLEET_PORT}", "--root-certificates", "/certs/ca.crt",
               "--auth-private-key", f"/certs/nodes/{name}", "--ledger-path",
               f"/ledgers/{name}.json", "--runtime-port", "9094"]
    if clusters is not None:
        command += ["--clusters", str(clusters)]
    if gpu is not None:
        command += ["--device", "cuda:0"]
    # the silo's own records, if its operator names them: a host directory mounted read-only
    # at /data, its source, the file in it and the schema the silo pins (a path in the
    # container, e.g. /data/schema.toml; unset for the benchmark slice)
    # (docs/deployment.md#docker-compose)
    own = name.upper().replace("-", "_")
    command += ["--data-source", f"${{{own}_SOURCE:-benchmark}}",
                "--data-path", f"/data/${{{own}_FILE:-}}",
                "--schema-file", f"${{{own}_SCHEMA:-}}"]
    text = f'''  {service}:
    <<: *{"gpu" if gpu is not None else "app"}
    profiles: ["{profile}"]
    restart: on-failure:5
    command:
{_list(command, 6)}
    volumes:
      - {silo_certs(index)}:/certs:ro  # its own key pair and ca.crt, nothing else
      - {service}-ledger:/ledgers
      - ${{{name.upper().replace("-", "_")}_DATA:-./docker/no-data}}:/data:ro
    depends_on:
      certs:
        condition: service_completed_successfully
      superlink:
        condition: service_healthy
'''
    if gpu is not None:
        text += f'''    deploy:
      resources:
        reservations:
          devices:
            - driver: nvidia
              device_ids: ["${{{name.upper().replace("-", "_")}_GPU:-{gpu}}}"]
              capabilities: [gpu]
'''
    return text


def _runner(profile: str, prefix: str, topology: Topology, silos: list[str]) -> str:
    # a SuperLink restarted during the run (a crash, `docker compose restart superlink`):
    # the runner waits for it and continues the run from its checkpoint in /results
    command = ["dpcfl", "submit", "--superlink", f"superlink:{API_PORT}",
               "--root-certificates", "/certs/ca.crt", "--app", "/app",
               "--resume-on-restart", "3",
               "--config", "/run-config/${DPCFL_RUN_CONFIG:-quick.toml}",
               "--set", f'clusters="{topology}"',
               "--set", f"min-clients={topology.num_clients}",
               "--set", f'out-dir="/results/{prefix or "cpu-"}run"']
    depends = "\n".join(f"      {s}:\n        condition: service_started" for s in silos)
    return f'''  {prefix}serverapp:
    <<: *app
    profiles: ["{profile}"]
    command:
{_list(command, 6)}
    volumes:
      - {CA_CERT}:/certs:ro  # ca.crt only: it checks the SuperLink's certificate
      - ${{DPCFL_RUN_CONFIG_DIR:-./examples}}:/run-config:ro
      - ./results/compose:/results  # the SuperLink's, as it names them: for `submit --resume`
    depends_on:
      certs:
        condition: service_completed_successfully
      superlink:
        condition: service_healthy
{depends}
'''


def _certs_script(keys: int) -> str:
    """The ``certs`` service's shell: ``dpcfl certs --keep`` as the image's user, then each
    party's share copied into its volume, mounted at ``/deliver/<volume>``, and given to that
    user, who reads it in the other containers. Every start copies again, so a key made anew
    (``dpcfl certs --overwrite`` by hand) reaches its party."""
    # 127.0.0.1: what key registration and Flower's SuperExec dial inside the SuperLink's
    # container
    make = ["dpcfl", "certs", "--out", "/certs", "--san", "superlink", "--san", "localhost",
            "--san", "127.0.0.1", "--nodes", str(keys), "--keep"]
    link = f"{DELIVER}/{SUPERLINK_CERTS}"
    # `$$` is a literal `$` to compose, which would otherwise substitute its own variables
    return f"""set -eu
HOME=/home/dpcfl setpriv --reuid=dpcfl --regid=dpcfl --init-groups {shlex.join(make)}
cd /certs
give() {{ install -o dpcfl -g dpcfl "$$@"; }}
give -m 644 ca.crt {DELIVER}/{CA_CERT}/
give -d {link}/nodes
give -m 644 ca.crt server.pem {link}/
give -m 600 server.key {link}/
for silo in {" ".join(silo_name(i) for i in range(keys))}; do
  give -m 644 nodes/$$silo.pub {link}/nodes/
  give -d {DELIVER}/$$silo-certs/nodes
  give -m 644 ca.crt {DELIVER}/$$silo-certs/
  give -m 644 nodes/$$silo.pub {DELIVER}/$$silo-certs/nodes/
  give -m 600 nodes/$$silo {DELIVER}/$$silo-certs/nodes/
done
"""


def _certs_service(keys: int) -> str:
    """The one-shot ``certs`` service (module docstring). It runs as root, not through the
    image's entrypoint, only to give the copies to the image's user: a new volume mounted
    where the image has no directory belongs to root."""
    shares = [CA_CERT, SUPERLINK_CERTS, *(silo_certs(i) for i in range(keys))]
    mounts = "\n".join(f"      - {volume}:{DELIVER}/{volume}" for volume in shares)
    script = "\n".join(f"        {line}" for line in _certs_script(keys).splitlines())
    return f'''  certs:
    <<: *app
    entrypoint:
      - sh
      - -c
      - |
{script}
    volumes:
      - {CERTS_VOLUME}:/certs  # the CA key: in this container's volume only
{mounts}
'''


def compose_yaml(options: ComposeOptions) -> str:
    full, small = options.topology, options.laptop
    keys = max(full.num_clients, small.num_clients)
    register = [f"/certs/nodes/{silo_name(i)}.pub" for i in range(keys)]
    server_command = ["dpcfl", "server", "--certs", "/certs", "--fleet-address",
                      f"0.0.0.0:{FLEET_PORT}", "--api-address", f"0.0.0.0:{API_PORT}",
                      "--state", "/state", "--ready-file", READY]
    for key in register:
        server_command += ["--register", key]
    parts = [f'''# Generated by
#   dpcfl topology compose --clusters {full} --laptop-clusters {small} --out compose.yaml
# Tests check that this file equals the generator's output: regenerate it, do not edit it.
#   docker/up.sh            # .env: cpu, {full.num_clients} silos {{{full}}}
#   docker/up.sh gpu        # one GPU per silo
#   docker/up.sh laptop     # {small.num_clients} silos {{{small}}}
# docker/up.sh starts the stack detached, follows the runner, stops the stack when the run
# ends and returns the run's exit code; a silo's crash does not stop it (`docker compose up
# --exit-code-from serverapp` stops everything at any container's exit: the one-shot `certs`
# service's, below, comes first, so the run would never start).
# Keys: the one-shot `certs` service makes the CA, the SuperLink's certificate and one key
# pair per silo once, in its own volume `certs` (later starts keep them), and copies to each
# party only its share: `silo-NN-certs` holds that silo's key pair and ca.crt,
# `superlink-certs` the SuperLink's certificate and key, ca.crt and the silos' public keys,
# `ca-cert` ca.crt for the runner. No other container holds the CA key, and none but a silo's
# own its private key: a silo's container can neither pose as another silo nor sign a
# SuperLink certificate that the silos would trust.
# A silo that crashes (out of memory, say) is started again (restart: on-failure:5) and rejoins
# under its node id; a SuperLink that crashes is started again too, and the runner continues
# the run from its checkpoint (submit --resume-on-restart). Docker restarts nothing the
# operator stopped (`stop`, `kill`).
# Results appear in ./results/compose/<profile>-run (-2, -3, ... for later runs); each silo's
# ledger lives in its own volume.
# The project name and default profile come from .env (COMPOSE_PROJECT_NAME, COMPOSE_PROFILES).

x-app: &app
  image: {IMAGE}
  build:
    context: .
    dockerfile: docker/Dockerfile
  restart: "no"
  init: true  # signals reach the command (as PID 1 it would ignore SIGTERM: killed after 10 s)
  environment:
    PYTHONUNBUFFERED: "1"

x-gpu: &gpu
  image: {GPU_IMAGE}
  build:
    context: .
    dockerfile: docker/Dockerfile
    args:
      TORCH_INDEX: https://download.pytorch.org/whl/cu126
  restart: "no"
  init: true  # signals reach the command (as PID 1 it would ignore SIGTERM: killed after 10 s)
  environment:
    PYTHONUNBUFFERED: "1"

services:
  superlink:
    <<: *app
    restart: on-failure:5  # a crashed SuperLink comes back; the runner resumes the run
    command:
{_list(["sh", "-c", f"rm -f {READY} && exec {shlex.join(server_command)}"], 6)}
    ports:
      - "{FLEET_PORT}:{FLEET_PORT}"
      - "{API_PORT}:{API_PORT}"
    volumes:
      - {SUPERLINK_CERTS}:/certs:ro  # its certificate and key, ca.crt, the silos' public keys
      - superlink-state:/state
      - ./results/compose:/results  # a directory of its own: `make demo` writes to ./results
    depends_on:
      certs:
        condition: service_completed_successfully
    healthcheck:
      test: ["CMD", "test", "-f", "{READY}"]
      interval: 2s
      retries: 90
      # registering the silo keys took over 180 s (90 x 2 s) on 2 loaded cores, and compose
      # then gave up: "dependency failed to start: ... superlink-1 is unhealthy"
      start_period: 900s
''', _certs_service(keys)]
    volumes = [CERTS_VOLUME, SUPERLINK_CERTS, CA_CERT,
               *(silo_certs(i) for i in range(keys)), "superlink-state"]
    for profile, prefix, topology, gpu in (("cpu", "", full, False), ("gpu", "gpu-", full, True),
                                           ("laptop", "laptop-", small, False)):
        names = []
        for i in range(topology.num_clients):
            parts.append(_silo_service(i, profile, prefix, i % options.gpus if gpu else None,
                                       None if topology == full else topology))
            names.append(f"{prefix}{silo_name(i)}")
            volumes.append(f"{prefix}{silo_name(i)}-ledger")
        parts.append(_runner(profile, prefix, topology, names))
    parts.append("volumes:\n" + "\n".join(f"  {v}: {{}}" for v in volumes) + "\n")
    return "\n".join(parts)
