"""Deployment pieces without a deployment: certificates, silo files, commands, validation, the
process table, the launcher's exit."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from dpcfl_flwr.config.settings import ConfigError, parse_node_config
from dpcfl_flwr.deploy.certs import keep_certificates, make_certificates
from dpcfl_flwr.deploy.localhost import free_port
from dpcfl_flwr.deploy.silo_file import (
    check_silo,
    deployed_settings,
    load_silo_file,
    node_config_text,
    supernode_command,
)
from dpcfl_flwr.deploy.superlink import ServerSettings, check_server, superlink_command
from dpcfl_flwr.runs.processes import descendants, exit_code_of

REPO = Path(__file__).resolve().parents[1]


def test_certificates_chain_to_the_ca_and_name_what_silos_dial(tmp_path):
    paths = make_certificates(tmp_path, ["superlink", "10.0.0.5"], ["silo-00", "silo-01"])
    ca = x509.load_pem_x509_certificate(paths.ca_certificate.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_certificate.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["superlink"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    for private, public in paths.nodes.values():
        assert private.stat().st_mode & 0o777 == 0o600
        # P-256: node authentication signs every request (P-384 costs ~7x more per request)
        assert load_ssh_public_key(public.read_bytes()).curve.name == "secp256r1"
    assert paths.ca_key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        make_certificates(tmp_path, ["superlink"], [])


def _silo_file(tmp_path) -> Path:
    make_certificates(tmp_path / "certs", ["localhost"], ["silo-00"])
    path = tmp_path / "silo.toml"
    path.write_text(f'''name = "silo-00"
superlink = "127.0.0.1:9092"
root-certificates = "certs/ca.crt"
auth-private-key = "certs/nodes/silo-00"
runtime-port = {free_port()}
[node]
partition-id = 0
epsilon = 4.0
delta = 1e-5
ledger-path = "ledgers/silo-00.json"
samples-per-client = 64
''')
    return path


def test_a_valid_silo_file_becomes_a_tls_supernode_command(tmp_path):
    silo, node = load_silo_file(_silo_file(tmp_path), {}, {})
    assert check_silo(silo, node).problems == []
    command = supernode_command(silo, node)
    assert command[:4] == [sys.executable, "-P", "-m", "dpcfl_flwr.deploy.supernode_launcher"]
    assert command[command.index("--idle-poll") + 1] == "0.5" and "--insecure" not in command
    assert command[command.index("--root-certificates") + 1] == str(tmp_path / "certs/ca.crt")
    assert "--auth-supernode-private-key" in command
    config = tomllib.loads(command[command.index("--node-config") + 1].replace(" ", "\n"))
    assert config == {"partition-id": 0, "epsilon": 4.0, "delta": 1e-5,
                      "ledger-path": str(tmp_path / "ledgers" / "silo-00.json"),
                      "samples-per-client": 64}
    assert node_config_text(node).startswith("partition-id=0")


def test_silo_file_problems_are_named(tmp_path):
    _silo_file(tmp_path)
    silo, node = load_silo_file(tmp_path / "silo.toml", {"root-certificates": "",
                                                          "insecure": False}, {})
    assert any("TLS needs root-certificates" in p for p in check_silo(silo, node).problems)
    silo, node = load_silo_file(tmp_path / "silo.toml",
                                {"root-certificates": str(tmp_path / "silo.toml")}, {})
    assert any("not a PEM certificate" in p for p in check_silo(silo, node).problems)
    with pytest.raises(ConfigError, match="'epsilon' = -1"):
        load_silo_file(tmp_path / "silo.toml", {}, {"epsilon": -1})
    with pytest.raises(ConfigError, match="unknown key 'colour'"):
        load_silo_file(tmp_path / "silo.toml", {"colour": "red"}, {})


def test_server_settings_are_checked_before_anything_starts(tmp_path):
    assert any("TLS needs --certs" in p for p in check_server(ServerSettings()))
    assert any("requires TLS" in p for p in check_server(ServerSettings(insecure=True)))
    make_certificates(tmp_path, ["localhost", "127.0.0.1"], [])
    settings = ServerSettings(certs=tmp_path, state=tmp_path / "state")
    assert check_server(settings) == []
    command = superlink_command(settings)
    assert "--enable-supernode-auth" in command and "--ssl-certfile" in command
    assert command[command.index("--fleet-api-type") + 1] == "grpc-rere"
    assert command[command.index("--database") + 1] == str(tmp_path / "state" / "state.db")
    in_memory = superlink_command(ServerSettings(certs=tmp_path, in_memory=True))
    assert in_memory[in_memory.index("--database") + 1] == ":flwr-in-memory:"


def test_client_dry_run_prints_the_plan_and_refuses_insecure_by_default(tmp_path):
    silo_file = _silo_file(tmp_path)
    shown = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", str(silo_file),
                            "--dry-run"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "1000"})  # no cell cut short
    assert shown.returncode == 0, shown.stderr
    plan = " ".join(shown.stdout.split())
    assert "epsilon=4, delta=1e-05" in plan and "supernode_launcher" in plan
    assert str(tmp_path / "ledgers" / "silo-00.json") in plan
    assert "fmnist partition 0 of topology {3,6,6,6} (cluster 0, rotation): 64 samples" in plan
    assert "draw authors, data seed 0" in plan and "private (noise multiplier 10" in plan
    assert "pinned: only a FAB that ships the code installed in" in plan
    assert "every 0.5 s" in shown.stdout
    slower = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", str(silo_file),
                             "--idle-poll", "2", "--dry-run"], capture_output=True, text=True,
                            timeout=120)
    assert slower.returncode == 0 and "every 2 s" in slower.stdout
    zero = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", str(silo_file),
                           "--idle-poll", "0", "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert zero.returncode == 2 and "idle-poll" in zero.stderr
    # Flags only, no certificate and no --insecure: refused, TLS is not optional by default.
    bad = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", "--name", "x",
                          "--partition-id", "0", "--superlink", "127.0.0.1:9092",
                          "--epsilon", "4", "--delta", "1e-5",
                          "--ledger-path", str(tmp_path / "x.json"), "--runtime-port",
                          str(free_port()), "--dry-run"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "TLS needs root-certificates" in bad.stderr


def test_a_silo_without_its_own_budget_or_ledger_refuses_to_start_with_one_line(tmp_path):
    silo_file = _silo_file(tmp_path)
    silo_file.write_text(silo_file.read_text().replace("delta = 1e-5\n", "").replace(
        'ledger-path = "ledgers/silo-00.json"\n', ""))
    silo, node = load_silo_file(silo_file, {}, {})
    assert [p for p in check_silo(silo, node).problems if "must be set" in p] == [
        "node config: delta, ledger-path must be set in the silo's own node config (silo "
        "file); a deployed silo never takes its budget or ledger from the server"]
    refused = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", str(silo_file),
                              "--epsilon", "4", "--dry-run"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "supernode_launcher" not in refused.stdout
    assert [line for line in refused.stderr.splitlines() if line.strip()] == [
        "error: node config: delta, ledger-path must be set in the silo's own node config "
        "(silo file); a deployed silo never takes its budget or ledger from the server"]
    given = subprocess.run([sys.executable, "-m", "dpcfl_flwr.cli", "client", str(silo_file),
                            "--delta", "1e-5", "--ledger-path", str(tmp_path / "l.json"),
                            "--dry-run"], capture_output=True, text=True, timeout=120)
    assert given.returncode == 0, given.stderr


def test_the_committed_silo_files_give_each_silo_its_records_of_the_quick_example():
    # What decides a silo's records (dpcfl_flwr/silo/silo.py): in simulation from the run config,
    # deployed from its silo file alone. The same for every silo of the quick example.
    from dpcfl_flwr.config.config_file import load_config

    quick = load_config(REPO / "examples" / "quick.toml", {})
    split = ("dataset", "clusters", "shift", "samples_per_client", "val_fraction",
             "test_samples", "data_draw", "data_seed", "epsilon", "delta")
    files = sorted((REPO / "clients").glob("silo-*.toml"))
    assert len(files) == quick.topology.num_clients
    for path in files:
        silo, node = load_silo_file(path, {}, {})
        deployed = deployed_settings(node)
        simulated = parse_node_config({"partition-id": node.partition_id}).resolved(
            quick, trust_run_config=True)
        assert [getattr(deployed, k) for k in split] == [getattr(simulated, k) for k in split]
        assert deployed.topology.cluster_of(node.partition_id) == simulated.topology.cluster_of(
            node.partition_id)
        assert deployed.metrics == "private" and deployed.ledger_path == str(
            REPO / "ledgers" / f"{silo.name}.json")


def test_relative_paths_in_a_silo_file_are_relative_to_the_file(tmp_path):
    silo_file = _silo_file(tmp_path)
    silo_file.write_text(silo_file.read_text() + 'data-dir = "data"\n')
    (tmp_path / "data").mkdir()
    _, node = load_silo_file(silo_file, {}, {})
    assert node.ledger_path == str(tmp_path / "ledgers" / "silo-00.json")
    assert node.data_dir == str(tmp_path / "data")


def test_descendants_finds_grandchildren_and_nothing_else():
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30; wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants(shell.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        commands = {Path(f"/proc/{pid}/cmdline").read_bytes() for pid in found}
        assert commands == {b"sleep\x0030\x00"} and len(found) == 2
        assert shell.pid in descendants(os.getpid()) and os.getpid() not in found
    finally:
        for pid in descendants(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.wait()


@pytest.mark.parametrize(("run", "code"), [
    (lambda: None, 0), (lambda: sys.exit(), 0), (lambda: sys.exit(3), 3),
    (lambda: sys.exit("a reason"), 1), (lambda: 1 / 0, 1)])
def test_the_launcher_exits_with_the_supernodes_own_code(run, code, capsys):
    assert exit_code_of(run) == code
    if code == 1:
        assert capsys.readouterr().err  # the reason or the traceback is printed


def test_a_port_in_use_is_named_with_its_process_before_the_superlink_starts(tmp_path):
    from dpcfl_flwr.deploy.superlink import listen_problems

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = free_port()
        settings = ServerSettings(fleet_address=f"127.0.0.1:{port}",
                                  api_address=f"127.0.0.1:{free}")
        program, *arguments = Path("/proc/self/cmdline").read_text().split("\0")
        assert listen_problems(settings) == [
            f"--fleet-address 127.0.0.1:{port}: port {port} is already in use by pid "
            f"{os.getpid()} ({' '.join([Path(program).name, *arguments[:2]])}); stop that "
            "process (a SuperLink left by a killed `dpcfl server`?) or choose another port"]
    assert listen_problems(settings) == []


def test_silos_are_told_an_address_they_can_dial(tmp_path):
    from dpcfl_flwr.deploy.superlink import dial_addresses

    make_certificates(tmp_path, ["superlink.example.org", "127.0.0.1", "::1"], [])
    assert dial_addresses(ServerSettings(certs=tmp_path, fleet_address="0.0.0.0:9092")) == [
        "superlink.example.org:9092", "127.0.0.1:9092", "[::1]:9092"]
    assert dial_addresses(ServerSettings(certs=tmp_path, fleet_address="10.0.0.5:9092")) == [
        "10.0.0.5:9092"]


def test_a_silo_keeps_its_open_session_in_the_flower_home_per_superlink_and_key(tmp_path):
    from dpcfl_flwr.flower_compat.supernode import session_file

    def arguments(superlink: str, key: str) -> list[str]:
        return ["--superlink", superlink, "--node-config", "partition-id=0",
                "--auth-supernode-private-key", key]

    silo_00 = session_file(arguments("10.0.0.5:9092", "certs/nodes/silo-00"), tmp_path)
    assert silo_00 is not None and silo_00.parent == tmp_path / "dpcfl-sessions"
    assert silo_00 == session_file(arguments("10.0.0.5:9092", "certs/nodes/silo-00"), tmp_path)
    assert silo_00 != session_file(arguments("10.0.0.5:9092", "certs/nodes/silo-01"), tmp_path)
    assert silo_00 != session_file(arguments("10.0.0.6:9092", "certs/nodes/silo-00"), tmp_path)
    assert session_file(["--superlink", "10.0.0.5:9092"], tmp_path) is None  # no node key


def test_a_silo_key_that_is_not_one_is_refused_before_the_superlink_starts(tmp_path):
    paths = make_certificates(tmp_path, ["localhost", "127.0.0.1"], ["silo-00"])
    bad = tmp_path / "bad.pub"
    bad.write_text("ecdsa-sha2-nistp256 AAAAnotakey silo-99\n")
    settings = ServerSettings(certs=tmp_path, register=[paths.nodes["silo-00"][1], bad,
                                                        tmp_path / "gone.pub"])
    assert check_server(settings) == [
        f"{bad} is not an OpenSSH elliptic-curve public key (the .pub files of `dpcfl certs` "
        "are)", f"public key {tmp_path / 'gone.pub'} does not exist"]


def test_a_superlink_certificate_its_own_tools_cannot_dial_is_refused_with_one_line(tmp_path):
    # key registration and Flower's SuperExec dial the control API at 127.0.0.1 over TLS
    make_certificates(tmp_path, ["superlink", "localhost"], [])
    problems = check_server(ServerSettings(certs=tmp_path, api_address="0.0.0.0:8000"))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert f"{tmp_path / 'server.pem'} is not valid for 127.0.0.1" in problems[0]
    assert "--san superlink --san localhost --san 127.0.0.1" in problems[0]
    other = tmp_path / "other"
    make_certificates(other, ["127.0.0.1"], [])
    (tmp_path / "server.pem").write_bytes((other / "server.pem").read_bytes())
    (tmp_path / "server.key").write_bytes((other / "server.key").read_bytes())
    assert [p for p in check_server(ServerSettings(certs=tmp_path)) if "was not issued by" in p]


def test_kept_certificates_get_a_new_superlink_certificate_when_a_name_is_missing(tmp_path):
    paths = make_certificates(tmp_path, ["superlink", "localhost"], ["silo-00"])
    ca, node_key = paths.ca_certificate.read_bytes(), paths.nodes["silo-00"][0].read_bytes()
    done = keep_certificates(tmp_path, ["superlink", "localhost", "127.0.0.1"],
                             ["silo-00", "silo-01"])
    assert done == ["made a new SuperLink certificate for superlink, localhost, 127.0.0.1 from "
                    "the kept CA: the kept one was not valid for 127.0.0.1",
                    "made 1 missing node key pair(s): silo-01"]
    assert paths.ca_certificate.read_bytes() == ca  # silos keep trusting the same CA
    assert paths.nodes["silo-00"][0].read_bytes() == node_key
    assert check_server(ServerSettings(certs=tmp_path)) == []
    assert keep_certificates(tmp_path, ["127.0.0.1"], ["silo-00"]) == []  # nothing to do
    paths.ca_key.unlink()
    with pytest.raises(ValueError, match="ca.key is not here to sign it"):
        keep_certificates(tmp_path, ["superlink.example.org"], [])


def test_free_ports_are_drawn_below_the_kernels_ephemeral_range(monkeypatch):
    from dpcfl_flwr.deploy import localhost

    floor = int(localhost.EPHEMERAL_RANGE.read_text().split()[0])
    drawn = {free_port() for _ in range(40)}
    assert all(floor - localhost.FREE_PORT_SPAN <= port < floor for port in drawn)
    assert len(drawn) > 30  # at random, not one port again and again
    for port in list(drawn)[:5]:  # free: a server can listen there
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
    # a port taken is never given: every draw hitting it, the kernel picks one
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with monkeypatch.context() as patch:
            patch.setattr(localhost.random.SystemRandom, "randrange", lambda self, a, b: port)
            assert free_port() != port
    monkeypatch.setattr(localhost, "EPHEMERAL_RANGE", localhost.Path("/nonexistent"))
    assert free_port() >= floor  # no range known: the kernel's pick


def test_a_port_is_never_handed_out_twice_so_a_superlink_never_lands_among_its_silos(
        tmp_path, monkeypatch):
    """A drawn port is unbound until its server starts: the Fleet port once fell inside the
    silos' runtime-port block, and one silo could not start."""
    from dpcfl_flwr.deploy import localhost

    draws = iter([])
    honest = localhost.random.SystemRandom.randrange

    def replay(self, low, high):  # the draws queued below first, then honest ones
        return next(draws, None) or honest(self, low, high)

    monkeypatch.setattr(localhost.random.SystemRandom, "randrange", replay)
    block = free_port(21)
    for port in range(block, block + 21):  # all free: each silo's server can listen there
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
    draws = iter([block, block + 7, block + 20])  # each inside the block: all refused
    assert free_port() not in range(block, block + 21)
    draws = iter([block - 5])  # a block overlapping the one handed out: refused
    assert free_port(10) not in range(block - 9, block + 21)
    with pytest.raises(ValueError, match="at least 1"):
        free_port(0)

    # a deployment whose Fleet draws land among its silos' ports: a block known to be free
    # (claimed, then handed back) is its silos' first draw
    silos = free_port(21)
    localhost._GIVEN.difference_update(range(silos, silos + 21))
    draws = iter([silos, silos + 7, silos + 20])
    deployment = localhost.LocalDeployment(tmp_path, clusters="3,6,6,6")
    silo_ports = range(silos, silos + 21)
    assert deployment.runtime_ports == silos and next(draws, None) is None  # all were drawn
    assert deployment.fleet not in silo_ports and deployment.api not in silo_ports
    assert deployment.fleet != deployment.api


def test_waiting_for_a_run_stops_as_soon_as_a_silo_has_ended(tmp_path):
    """A silo that cannot start (here: a silo file that is not there) ends its process; the
    wait for the run then says so at once, with the silo's last log line, instead of waiting
    for the run, which would wait for that silo until its wait-for-clients ran out."""
    import sys

    from dpcfl_flwr.deploy.localhost import LocalDeployment

    deployment = LocalDeployment(tmp_path, clusters="1,1")
    deployment.start("silo-00", "client", "no-such-silo.toml")  # the real `dpcfl client`
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(RuntimeError, match=r"silo-00 ended \(exit 2\) before the run: "
                                               r".*'no-such-silo.toml' does not exist"):
            deployment.wait_run(run, timeout=300)  # a missed silo: TimeoutExpired instead
        assert run.poll() is None  # the run was still going
    finally:
        run.kill()
        run.wait()
        deployment.down()
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert deployment.wait_run(ended, timeout=120) == 3  # no silo left: the run's own status
