"""`dpcfl simulate --ray-address`: a run on a two-node Ray cluster of this machine, where the
silos ran as Ray's own records say, and an address with no cluster behind it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import pytest

TINY = """method = "global"
clusters = "2,2"
samples-per-client = 64
num-server-rounds = 2
test-samples = 40
eval-every = 2
silo-cpus = 0.5
"""
NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20}  # Ray's floor is 75 MiB


def _simulate(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "simulate", *arguments],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node of 1 CPU each (separate raylets on this machine), shut down
    whatever the test does; skips only when Ray cannot start here. Its files, and the address
    file a head leaves for ``ray.init()`` to find, go to a directory of its own (RAY_TMPDIR),
    so no other Ray user of this machine joins it by mistake."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="dpcfl-rc-")  # short: Ray's sockets
    try:
        try:
            cluster = Cluster(initialize_head=True,
                              head_node_args={**NODE, "include_dashboard": False})
        except Exception as exc:  # noqa: BLE001 - any reason Ray cannot start is a skip
            pytest.skip(f"cannot start a Ray head on this machine: {exc}")
        try:
            cluster.add_node(**NODE)
            yield cluster
        finally:
            cluster.shutdown()
    finally:
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
        if saved is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = saved


def _silo_work_per_node(address: str) -> tuple[Counter[str], Counter[str], set[str]]:
    """From Ray's GCS (its actor table and task events, not our logs): how many silo actors
    (Flower's ``ClientAppActor``) each node held, how many of their ``run`` tasks (one silo's
    message each) ran on each node, and the ids of the cluster's nodes."""
    import ray
    from ray._common.utils import binary_to_hex
    from ray._private import state
    from ray.core.generated import gcs_pb2

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = {node["NodeID"] for node in ray.nodes()}
        node_of_actor = {actor_id: actor["Address"]["NodeID"]
                         for actor_id, actor in state.actors().items()
                         if actor["ActorClassName"] == "ClientAppActor"}
        tasks: dict[str, str] = {}
        for raw in state.state._connect_and_get_accessor().get_task_events():
            event = gcs_pb2.TaskEvents.FromString(raw)
            actor = binary_to_hex(event.task_info.actor_id)
            if event.task_info.name.endswith(".run") and actor in node_of_actor:
                tasks[binary_to_hex(event.task_id)] = node_of_actor[actor]
        return Counter(node_of_actor.values()), Counter(tasks.values()), nodes
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_silos_run_on_both_nodes_of_a_ray_cluster(two_nodes, tmp_path):
    config, out = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY)
    done = _simulate("--config", str(config), "--out", str(out), "--quiet",
                     "--ray-address", two_nodes.address, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and len(results["clients"]) == 4
    actors, runs, nodes = _silo_work_per_node(two_nodes.address)
    # silo-cpus = 0.5 on nodes of 1 CPU: Flower's pool held two silo actors on each node
    assert len(nodes) == 2 and actors == {node: 2 for node in nodes}, actors
    assert set(runs) == nodes, runs  # and each node ran silos' messages
    # every silo trained in each of the 2 rounds, so at least 8 messages went to the actors
    assert sum(runs.values()) >= 4 * 2, runs


@pytest.mark.slow
def test_a_local_run_starts_its_own_ray_beside_a_cluster(two_nodes, tmp_path, monkeypatch):
    """Without --ray-address a run starts a Ray of its own even where ``ray.init()`` would
    join a cluster (the address file a head leaves, or RAY_ADDRESS): it used to join, and
    Ray then refused its --cpus (every local run on a machine with a cluster failed)."""
    config, out = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY)
    actors_before, _, _ = _silo_work_per_node(two_nodes.address)
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    done = _simulate("--config", str(config), "--out", str(out), "--quiet", "--cpus", "1",
                     timeout=300)
    monkeypatch.delenv("RAY_ADDRESS")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "results.json").read_text())["complete"]
    assert _silo_work_per_node(two_nodes.address)[0] == actors_before  # no silo joined it


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_address_without_a_cluster_fails_in_one_line(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    started = time.monotonic()
    done = _simulate("--config", str(config), "--out", str(tmp_path / "run"),
                     "--ray-address", f"127.0.0.1:{_free_port()}", timeout=120)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode != 0 and "no Ray cluster answers there" in said
    assert "Traceback" not in said and len(said.splitlines()) <= 2, said  # rich may wrap
    assert time.monotonic() - started < 60  # Ray's own attempt waits 145 s
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("address, says", [
    ("no-such-host.invalid:6379", "cannot resolve no-such-host.invalid"),
    ("ray://10.0.0.5:10001", "not a Ray Client ray:// address"),
    ("10.0.0.5", "expected host:port"),
    ("10.0.0.5:99999", "expected host:port"),
])
def test_bad_addresses_are_named(address, says):
    from dpcfl_flwr.runs.ray_cluster import ClusterError, probe

    with pytest.raises(ClusterError, match=re.escape(says)):
        probe(address)


def test_cpus_and_a_cluster_are_refused_together(tmp_path):
    done = _simulate("--ray-address", "127.0.0.1:6379", "--cpus", "2", timeout=60)
    assert done.returncode != 0 and "--cpus sizes a local Ray" in done.stdout + done.stderr


def test_silo_resources_come_from_the_run_config():
    from dpcfl_flwr.config.settings import ConfigError, parse_run_config
    from dpcfl_flwr.strategies.checkpoint import run_config_differences

    experiment = parse_run_config({"silo-cpus": 0.5, "silo-gpus": 0.25})
    assert (experiment.silo_cpus, experiment.silo_gpus) == (0.5, 0.25)
    with pytest.raises(ConfigError, match="silo-cpus"):
        parse_run_config({"silo-cpus": 0})
    # where a run's silos ran is not what they computed: a resumed run may change it
    before = parse_run_config({}).to_run_config()
    assert run_config_differences(before, experiment.to_run_config()) == []


def test_a_cluster_where_no_node_fits_a_silo_is_one_line(two_nodes):
    import ray

    from dpcfl_flwr.runs.ray_cluster import ClusterError, check_fits, connect

    connect(two_nodes.address, verbose=False)
    try:
        assert check_fits({"num_cpus": 1.0, "num_gpus": 0.0})["CPU"] == 2
        with pytest.raises(ClusterError, match=re.escape(
                "(silo-cpus = 2, silo-gpus = 0); its nodes have: CPU 1, GPU 0; CPU 1, GPU 0")):
            check_fits({"num_cpus": 2.0, "num_gpus": 0.0})
    finally:
        ray.shutdown()
