"""The compose stack as README runs it (``docker/up.sh laptop``), on a real Docker engine: the
laptop profile (7 silos over TLS) runs a small run to its end, survives a silo's crash, and the
stack stops by itself with the run's exit code.

The test starts a Docker engine of its own (``dockerd`` with its own data root, exec root,
pidfile and socket; stopped by its pid whatever happens), builds the Python base image from the
Debian archive (``docker/base-image.sh``) and the app's image against a package index served
from this machine (``docker/local-index.sh``), then runs ``docker/up.sh laptop`` with the run
made small (2 rounds) by a compose override, as a user would change it, and SIGKILLs one
silo's container process as it starts (a crash: Docker restarts it). It checks the exit code,
that the crashed silo was restarted and no container is left running, the results directory
(complete, every silo evaluated, the structure found) and every silo's ledger in its volume
(charged, within its budget).

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
    container_state,
    engine_unavailable,
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
        code = up.wait(timeout=1200)
        took = time.monotonic() - started
        sampler.done.set()
        assert code == 0, f"docker/up.sh exited {code}: {log.read_text()[-4000:]}"
        assert container_state(engine, crashed)["RestartCount"] >= 1
        running = subprocess.run([*compose, "ps", "--quiet", "--status", "running"],
                                 cwd=project, env=engine, capture_output=True, text=True,
                                 timeout=120, check=True).stdout.split()
        assert running == [], "docker/up.sh left containers running"
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
