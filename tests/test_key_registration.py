"""``dpcfl server --register``: silo keys registered with a real SuperLink (TLS, node
authentication), checked with Flower's own ``flwr supernode list``.

The keys go out through one Control API client in the server's process; with Flower's tuning
gate closed (``DPCFL_FLOWER_TUNING=0``) through ``flwr supernode register``, once per key.
Both ways register the same nodes under the key files' names, leave a key registered before
as it is when the SuperLink restarts on its kept state, and put a refusal in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from dpcfl_flwr.deploy.certs import make_certificates
from dpcfl_flwr.deploy.localhost import BIN_DIR, LocalDeployment, free_port
from dpcfl_flwr.deploy.superlink import ServerSettings, register_keys, write_connection


def _listed_nodes(deployment: LocalDeployment) -> dict[str, str]:
    """Flower's own view: node id -> status, from ``flwr supernode list``."""
    listed = subprocess.run([str(BIN_DIR / "flwr"), "supernode", "list", "dpcfl", "--format",
                             "json"], env=deployment.env, cwd=deployment.root, text=True,
                            capture_output=True, timeout=120, check=False)
    answer = json.loads(listed.stdout[listed.stdout.find("{"):])
    assert answer.get("success") is True, listed.stdout + listed.stderr
    return {node["node-id"]: node["status"] for node in answer["nodes"]}


@pytest.mark.slow
@pytest.mark.parametrize("tuning", ["on", "off"])
def test_the_server_registers_every_silo_key_once_and_keeps_them_across_a_restart(
        tmp_path, tuning):
    deployment = LocalDeployment(tmp_path / "deployment", clusters="1,2")
    if tuning == "off":
        deployment.env["DPCFL_FLOWER_TUNING"] = "0"
    try:
        deployment.up()
        assert "registered 3 silo key(s)\n" in deployment.log("server")
        nodes = _listed_nodes(deployment)
        assert list(nodes.values()) == ["registered"] * 3  # three nodes, none online yet
        deployment.kill("server")
        deployment.restart_server()  # the same SQLite state: every key is already known
        assert "registered 0 silo key(s), 3 registered before" in deployment.log("server")
        assert _listed_nodes(deployment) == nodes  # the same node ids, nothing added
        # a silo's own key is one of them: it connects and its node goes online
        deployment.silo(2)
        deadline = time.monotonic() + 120
        while "online" not in _listed_nodes(deployment).values():
            assert time.monotonic() < deadline, deployment.log("silo-02")
            time.sleep(1)
        assert sorted(_listed_nodes(deployment)) == sorted(nodes)
    finally:
        deployment.down()


def test_a_superlink_that_does_not_answer_refuses_every_key_in_one_line_each(tmp_path):
    """Nothing listens at the connection's address: each key's failure is Flower's own
    "unavailable" line, not a traceback."""
    paths = make_certificates(tmp_path / "certs", ["127.0.0.1"], ["silo-00", "silo-01"])
    settings = ServerSettings(certs=tmp_path / "certs", api_address=f"127.0.0.1:{free_port()}",
                              flwr_home=tmp_path / "flwr")
    write_connection(settings)
    keys = [paths.nodes[name][1] for name in ("silo-00", "silo-01")]
    done = register_keys(settings, keys)
    assert done.registered == [] and done.already == []
    assert len(done.failures) == 2
    for key, failure in zip(keys, done.failures, strict=True):
        assert failure.startswith(f"could not register {key}: ")
        assert "\n" not in failure and "Traceback" not in failure
        assert "superlink" in failure.lower()  # Flower's line names what it could not reach
    assert os.environ.get("FLWR_HOME") != str(tmp_path / "flwr")  # left as it was
