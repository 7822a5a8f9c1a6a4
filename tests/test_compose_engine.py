"""The compose stack as README runs it (``docker/up.sh laptop``), on a real Docker engine: the
laptop profile (7 silos over TLS) runs a small run to its end, survives a silo's crash, and the
stack stops by itself with the run's exit code.

The test starts a Docker engine of its own (``dockerd`` with its own data root, exec root,
pidfile and socket; stopped by its pid whatever happens), builds the Python base image from the
Debian archive (``docker/base-image.sh``) and the app's image against a package index served
from this machine (``docker/local-index.sh``), then runs ``docker/up.sh laptop`` with the run
made small (2 rounds) by a compose override, as a user would change it, and SIGKILLs one
silo's container process as it starts (a crash: Docker restarts it). During the run it looks
into another silo's container: the only key files there are its own key pair and ``ca.crt``
(readable by the silo's user), and it can neither find nor read another silo's key, the CA
key or the SuperLink's; the SuperLink's container holds no private key but its own. It checks
the exit code, that the crashed silo was restarted and no container is left running, that no
container but the one-shot ``certs`` mounts the CA key's volume and a silo's key volume is
mounted by that silo alone, the results directory (complete, every silo evaluated, the
structure found) and every silo's ledger in its volume (charged, within its budget).

What it keeps between runs, in ``$DPCFL_DOCKER_CACHE`` (default ``/var/cache/dpcfl-docker``): the
engine's data root (images and build layers), the base image's tarball, the wheels of the local
index and the Compose v2 plug-in. Cost on 2 cores: 226-302 s with that cache warm (the image's
last layers rebuilt in 1-13 s, the stack 214-230 s), 625-644 s when the image is built from its
base, ~13 minutes on a fresh machine (debootstrap ~3, wheels ~1, image ~4, run ~5). It skips,
saying why, where no engine can run: not root, no dockerd or debootstrap (scripts/setup.sh
installs both), no cgroups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpcfl_flwr.deploy.compose import IMAGE
from dpcfl_flwr.deploy.docker_engine import (
    CACHE,
    EngineError,
    MemorySampler,
    build_image,
    compose_project,
    container_mounts,
    container_state,
    docker,
    engine_unavailable,
    exec_in,
    private_engine,
    run_stack,
    volume_ledgers,
)
from dpcfl_flwr.results.recorder import structure_found

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROJECT = "dpcfl-compose-test"
SILOS = 7  # the laptop profile's {1,2,2,2}
SMALL_RUN = ["num-server-rounds=2", "eval-every=2"]
CRASHED = "laptop-silo-01"  # the silo whose process the test kills as it starts
OBSERVED = "silo-03"  # the silo whose container (laptop-silo-03) the test looks into
KEYS = 21  # the node key pairs compose.yaml makes: the cpu profile's silos
#: How `dpcfl certs` names its files: what a key file found in a container is called.
KEY_NAMES = ["ca.key", "ca.crt", "server.key", "server.pem", "silo-[0-9][0-9]",
             "silo-[0-9][0-9].pub"]
SILO_USER = "10001"  # the image's user (docker/Dockerfile), who runs every service's command


def key_files(engine: dict[str, str], container: str) -> set[str]:
    """Every file in ``container``'s file system (its mounts included) named as ``dpcfl
    certs`` names its files."""
    names = [arg for name in KEY_NAMES for arg in ("-o", "-name", name)][1:]
    found = exec_in(engine, container, "find", "/", "(", "-path", "/proc", "-o", "-path",
                    "/sys", ")", "-prune", "-o", "-type", "f", "(", *names, ")", "-print")
    assert found.returncode == 0, f"find in {container}: {found.stderr}"
    return set(found.stdout.split())


def named_volumes(engine: dict[str, str], container: str) -> dict[str, tuple[str, bool]]:
    """The project's volumes ``container`` mounts: name -> (where, read-write)."""
    return {str(m["Name"]).removeprefix(f"{PROJECT}_"): (str(m["Destination"]), bool(m["RW"]))
            for m in container_mounts(engine, container)
            if m["Type"] == "volume" and str(m["Name"]).startswith(f"{PROJECT}_")}


def assert_silo_sees_only_its_own_key(engine: dict[str, str], silo: str) -> None:
    """In ``silo``'s running container: its key pair and ca.crt, its user's to read, and no
    other key file anywhere, which also means none can be read."""
    container = f"{PROJECT}-laptop-{silo}-1"
    own = {"/certs/ca.crt": "644", f"/certs/nodes/{silo}": "600",
           f"/certs/nodes/{silo}.pub": "644"}
    assert key_files(engine, container) == set(own)
    listing = exec_in(engine, container, "ls", "-lnR", "/certs")
    print(f"{container}: ls -lnR /certs\n{listing.stdout}")
    modes = exec_in(engine, container, "stat", "-c", "%n %u %a", *own).stdout.splitlines()
    assert modes == [f"{path} {SILO_USER} {mode}" for path, mode in own.items()]
    for path in own:
        read = exec_in(engine, container, "cat", path, user=SILO_USER)
        assert read.returncode == 0 and read.stdout, f"{silo} cannot read {path}: {read.stderr}"
    other = "silo-00" if silo != "silo-00" else "silo-01"
    for path in ("/certs/ca.key", "/certs/server.key", f"/certs/nodes/{other}"):
        read = exec_in(engine, container, "cat", path)  # as root: not there at all
        assert read.returncode != 0 and "No such file" in read.stderr, (path, read)
    assert named_volumes(engine, container) == {
        f"{silo}-certs": ("/certs", False), f"laptop-{silo}-ledger": ("/ledgers", True)}


def assert_superlink_holds_no_silo_key(engine: dict[str, str], silo: str) -> None:
    """In the SuperLink's running container: its own certificate and key, ca.crt and the
    silos' public keys (``silo``'s the same as in that silo's container); no private key of a
    silo, no CA key."""
    container = f"{PROJECT}-superlink-1"
    assert key_files(engine, container) == {
        "/certs/ca.crt", "/certs/server.pem", "/certs/server.key",
        *(f"/certs/nodes/silo-{i:02d}.pub" for i in range(KEYS))}
    public = [exec_in(engine, name, "cat", f"/certs/nodes/{silo}.pub").stdout
              for name in (container, f"{PROJECT}-laptop-{silo}-1")]
    assert public[0] and public[0] == public[1]


def assert_only_the_cert_maker_holds_private_keys(engine: dict[str, str]) -> None:
    """Over every container of the stack, run or stopped: the CA key's volume is mounted by
    the one-shot ``certs`` alone, a silo's key volume by it and that silo, the runner's
    ``ca-cert`` read-only."""
    containers = docker_names(engine)
    holders: dict[str, set[str]] = {}
    for container in containers:
        for volume in named_volumes(engine, container):
            holders.setdefault(volume, set()).add(container.removeprefix(f"{PROJECT}-"))
    assert holders["certs"] == {"certs-1"}, holders["certs"]
    assert holders["superlink-certs"] == {"certs-1", "superlink-1"}
    assert holders["ca-cert"] == {"certs-1", "laptop-serverapp-1"}
    for i in range(SILOS):
        assert holders[f"silo-{i:02d}-certs"] == {"certs-1", f"laptop-silo-{i:02d}-1"}
    assert named_volumes(engine, f"{PROJECT}-laptop-serverapp-1") == {
        "ca-cert": ("/certs", False)}


def docker_names(engine: dict[str, str]) -> list[str]:
    """The names of every container of the test's compose project."""
    return docker(engine, "ps", "--all", "--format", "{{.Names}}", "--filter",
                  f"label=com.docker.compose.project={PROJECT}", timeout=60).stdout.split()


@pytest.fixture(scope="module")
def engine() -> Iterator[dict[str, str]]:
    """A private dockerd; the environment that points docker and docker compose at it."""
    reason = engine_unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        with private_engine(CACHE) as env:
            yield env
    except EngineError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def image(engine) -> str:
    """The app's image, built as README's "Building without a registry" says."""
    took, size = build_image(engine, REPO, CACHE)
    print(f"image built in {took:.0f} s, {size / 1e9:.2f} GB")
    return IMAGE


def test_docker_compose_up_runs_the_laptop_profile_to_its_end_on_a_real_engine(
        engine, image, tmp_path):
    project = compose_project(tmp_path, REPO, "laptop-serverapp", SMALL_RUN)
    compose = ["docker", "compose", "-p", PROJECT, "--profile", "laptop"]
    sampler = MemorySampler(engine)
    started = time.monotonic()
    log = CACHE / "compose-up.log"
    try:
        sampler.start()
        up = run_stack(project, "laptop", PROJECT, engine, log)
        # A silo crashes as soon as it runs (its init process SIGKILLed from the host, not a
        # `docker kill`): Docker starts it again, it rejoins, and the run, which waits for all
        # 7 silos, goes on; under `up --exit-code-from` this ended the whole stack.
        crashed = f"{PROJECT}-{CRASHED}-1"
        deadline = time.monotonic() + 900
        while not (pid := int(container_state(engine, crashed).get("Pid") or 0)):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        # What each party can read, looked at while the run goes on.
        while not container_state(engine, f"{PROJECT}-laptop-{OBSERVED}-1").get("Running"):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        assert_silo_sees_only_its_own_key(engine, OBSERVED)
        assert_superlink_holds_no_silo_key(engine, OBSERVED)
        code = up.wait(timeout=1200)
        took = time.monotonic() - started
        sampler.done.set()
        assert code == 0, f"docker/up.sh exited {code}: {log.read_text()[-4000:]}"
        assert container_state(engine, crashed)["RestartCount"] >= 1
        running = subprocess.run([*compose, "ps", "--quiet", "--status", "running"],
                                 cwd=project, env=engine, capture_output=True, text=True,
                                 timeout=120, check=True).stdout.split()
        assert running == [], "docker/up.sh left containers running"
        assert_only_the_cert_maker_holds_private_keys(engine)
        ledgers = volume_ledgers(engine, [f"{PROJECT}_laptop-silo-{i:02d}-ledger"
                                          for i in range(SILOS)])
    finally:
        sampler.done.set()
        if "up" in locals() and up.poll() is None:
            up.send_signal(signal.SIGTERM)  # docker/up.sh stops the stack on SIGTERM
            up.wait(timeout=120)
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], cwd=project, env=engine,
                       capture_output=True, timeout=300, check=False)
    print(f"docker/up.sh laptop, {SMALL_RUN}: {took:.0f} s; peak memory (MiB): "
          + ", ".join(f"{name.removeprefix(PROJECT + '-')} {mib:.0f}"
                      for name, mib in sorted(sampler.peak.items())))
    results = json.loads((project / "results/compose/laptop-run/results.json").read_text())
    assert results["complete"], results["summary"]
    assert results["summary"]["silos_evaluated"] == SILOS, results["summary"]
    for client in results["clients"]:
        assert client["evaluated_round"] == 2 and not client["stale"], client
        assert not client["dropped_rounds"] and not client["refused_rounds"], client
    # The structure, as round 1's clustering found it from the silos' noisy updates. The
    # final assignment of a 2-round run is its one private selection round's, noisy by design
    # (a 4-round run here ended on the true partition, ARI 1.0).
    partitions = results["clustering"]["partitions"]
    truth = {c["partition"]: c["true_cluster"] for c in results["clients"]}
    found = dict(zip(partitions, results["clustering"]["labels"], strict=True))
    assert structure_found(truth, found) == (True, True), results["clustering"]
    assert sorted(ledgers) == [f"silo-{i:02d}" for i in range(SILOS)]
    for name, ledger in ledgers.items():
        silo = tomllib.loads((REPO / "clients" / f"{name}.toml").read_text())["node"]
        spent = ledger.epsilon(silo["delta"])
        assert 0 < spent <= silo["epsilon"], f"{name} spent {spent} of {silo['epsilon']}"
