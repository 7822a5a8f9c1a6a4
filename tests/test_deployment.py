"""Real silos on 127.0.0.1: one SuperLink and four SuperNodes as separate processes, with TLS
and node authentication, driven by `flwr run` exactly as on real machines.

Covers: a complete run; a silo killed while it holds a round's message (the round goes on
without it at once, and the results name it) that restarts, rejoins within seconds (ending its
stale session itself) and continues its ledger; a silo whose budget is spent refusing
to train; a SuperNode with a certificate from another CA and one with an unregistered key being
refused; no process outliving a killed silo or the deployment. The compose file is validated
with Debian's docker-compose.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from dpcfl_flwr.data import Topology
from dpcfl_flwr.deploy.compose import ComposeOptions, compose_yaml, silo_files
from dpcfl_flwr.deploy.localhost import DPCFL, LocalDeployment, free_port
from dpcfl_flwr.flower_compat.ended_sessions import SESSION_ENDED
from dpcfl_flwr.privacy.accountants import DEFAULT_ACCOUNTANT, accountant_named
from dpcfl_flwr.privacy.ledger import GaussianSteps, PrivacyBudget, PrivacyLedger
from dpcfl_flwr.privacy.schedule import GaussianPhase
from dpcfl_flwr.runs.processes import descendants

REPO = Path(__file__).resolve().parents[1]
SILOS = 4
SMALL = {"rdpcfl.n-clusters": 2, "samples-per-client": 64, "test-samples": 40}
SPLIT = ["--samples-per-client", "64", "--test-samples", "40"]  # each silo's own, as the run's


def _wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout} s"
        assert process.poll() is None or path.exists(), "the run ended early"
        time.sleep(1)


def _processes_of(deployment: LocalDeployment) -> set[int]:
    """Every process started by ``deployment``: they all inherit its FLWR_HOME (command lines
    do not always name its directory: the supervisors' and the SuperLink's paths are
    relative, the runtimes' name only a port)."""
    marker = f"\0FLWR_HOME={deployment.env['FLWR_HOME']}\0".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker in b"\0" + (entry / "environ").read_bytes():
                found.add(int(entry.name))
    return found


def _alive(pids: set[int], grace: float = 15) -> set[int]:
    """Which of ``pids`` still run (zombies do not count) after up to ``grace`` s."""
    deadline = time.monotonic() + grace
    while True:
        running = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat[stat.rindex(")") + 2] != "Z":
                    running.add(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def _results(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = LocalDeployment(tmp_path_factory.mktemp("deployment"), clusters="2,2")
    dep.up()
    dep.use_snapshot(REPO)  # the app the silos run and `flwr run` sends
    for i in range(SILOS):
        dep.silo(i, *SPLIT)
    assert len(_processes_of(dep)) > SILOS  # the check after down() can see them
    yield dep
    dep.down()
    assert not _alive(_processes_of(dep)), "processes outlived the deployment"


@pytest.mark.slow
def test_a_run_over_grpc_with_tls_and_node_authentication(deployment):
    started = time.monotonic()
    run = deployment.flwr_run("run-tls", deployment.root, **SMALL, **{"num-server-rounds": 3,
                                                           "eval-every": 3})
    run.wait(timeout=900)
    wall = time.monotonic() - started
    results = _results(deployment.root / "run-tls")
    assert results["complete"] and len(results["clients"]) == SILOS
    assert all(c["test_accuracy"] is not None for c in results["clients"])
    assert all(c["epsilon_spent"] <= c["epsilon_budget"] for c in results["clients"])
    assert all(not c["dropped_rounds"] for c in results["clients"])
    server_log = deployment.log("server")
    assert "--enable-supernode-auth" in server_log and "--ssl-certfile" in server_log
    assert "holds an empty SuperNode poll up to 10 s until work arrives" in server_log
    assert "Runtime API requests skip the Control API's middleware" in server_log
    # the ServerApp's objects move in batches, and no reply is handed over half-pushed (its
    # missing objects would be pulled one by one, after Flower's back-off)
    assert "/v1/runtime/dpcfl-push-objects HTTP" in server_log
    assert "/v1/runtime/dpcfl-pull-objects HTTP" in server_log
    assert "/v1/runtime/pull-object HTTP" not in server_log
    assert "/v1/runtime/push-object HTTP" not in server_log
    for i in range(SILOS):  # the FAB checked ahead: every message answered in the SuperNode
        log = deployment.log(f"silo-{i:02d}")
        received = log.count("Receiving: ")
        assert "ClientApp tasks are answered in the SuperNode's process" in log
        assert "ships the installed app; its messages are answered in this process" in log
        assert received >= 5
        assert "polls the SuperLink every 0.5 s when idle" in log
        assert log.count("message answered in this process") == received
    (deployment.root / "wall-seconds.txt").write_text(f"{wall:.1f}\n")
    print(f"\nmulti-process run over gRPC+TLS: {wall:.1f} s wall, "
          f"{results['wall_seconds']:.1f} s inside the ServerApp")


@pytest.mark.slow
def test_a_killed_silo_is_dropped_rejoins_and_keeps_its_ledger_and_a_spent_one_refuses(
        deployment):
    root = deployment.root
    # Fresh budgets for this run: every silo gets a new ledger file ...
    for i in range(SILOS):
        deployment.stop(f"silo-{i:02d}")
    ledgers = root / "ledgers-faults"
    # ... except silo 3, whose earlier runs already spent eps = 9.993 of 10 (by its default
    # accountant, PLD, which measures the authors' z 0.5249 for that at 8.35).
    z = accountant_named(DEFAULT_ACCOUNTANT).calibrate([GaussianPhase(1.0, 1)], 9.993, 1e-4)
    spent = PrivacyLedger([GaussianSteps(z, 1.0, 1, round=1)])
    spent.save(ledgers / "silo-03.json")
    # Silo 1 draws more records than the others, so that its training takes seconds and the
    # kill below lands while it holds a round's message.
    big = ["--samples-per-client", "3000", "--test-samples", "40"]
    for i in range(SILOS):
        deployment.silo(i, *(big if i == 1 else SPLIT),
                        "--ledger-path", str(ledgers / f"silo-{i:02d}.json"))
    # The restarted silo ends its killed SuperNode's session itself and rejoins within
    # seconds (the SuperLink would hold that session ~60 s). The message it held died with
    # it: the SuperLink answers it with an error at the restart, so the round goes on without
    # silo 1 instead of waiting for the round timeout (600 s here, an hour by default).
    run = deployment.flwr_run("run-faults", deployment.root, **SMALL, **{
        "num-server-rounds": 8, "eval-every": 8, "round-timeout": 600.0})
    progress = root / "run-faults" / "progress.jsonl"
    _wait_for(progress, '"round": 1,', run, timeout=400)
    log = root / "silo-01.log"
    deadline = time.monotonic() + 300
    while True:  # kill silo 1 while it holds a message: received more than it answered
        text = log.read_text()
        if text.count("Receiving: ") > text.count("message answered in this process"):
            break
        assert time.monotonic() < deadline and run.poll() is None, "silo 1 got no message"
        time.sleep(0.02)
    finished = progress.read_text().count('"event": "round"')
    deployment.kill("silo-01")
    before = PrivacyLedger.load(ledgers / "silo-01.json").entries
    restarted = time.monotonic()
    silo = deployment.silo(1, *big, "--ledger-path", str(ledgers / "silo-01.json"))
    _wait_for(log, "SuperNode ID: ", silo, timeout=120)
    rejoin = time.monotonic() - restarted
    assert "ended this silo's previous session" in deployment.log("silo-01")
    assert "refused" not in deployment.log("silo-01")
    print(f"\nkilled silo rejoined {rejoin:.1f} s after its restart")
    assert rejoin < 45  # ~5 s on an idle 2-core machine; the old session's expiry was ~60 s
    run.wait(timeout=1500)
    results = _results(root / "run-faults")
    clients = {c["partition"]: c for c in results["clients"]}
    assert results["complete"]
    # The round under way at the kill is the one silo 1 dropped, and the run's log says why:
    # the SuperLink's answer for the ended session, not the round timeout.
    assert clients[1]["dropped_rounds"] == [finished + 1]
    run_log = (root / "run-faults.log").read_text()
    assert (f"round {finished + 1}: silo 1 failed (code 5): {SESSION_ENDED}"
            in " ".join(run_log.split())), run_log[-3000:]
    after = PrivacyLedger.load(ledgers / "silo-01.json")
    assert after.entries[:len(before)] == before  # the restart continued the ledger
    assert max(e.round or 0 for e in after.entries) > 3  # ... and trained after rejoining
    budget = PrivacyBudget(10.0, 1e-4)
    assert after.spent(budget) <= 10.0
    assert clients[3]["refused_rounds"] == [1] and clients[3]["exhausted"]
    assert PrivacyLedger.load(ledgers / "silo-03.json").entries == spent.entries
    assert all(c["epsilon_spent"] <= c["epsilon_budget"] for c in clients.values())


@pytest.mark.slow
def test_a_foreign_certificate_and_an_unregistered_key_are_refused(deployment):
    root = deployment.root
    deployment.run("certs", "--out", "other-ca", "--san", "127.0.0.1", "--nodes", "1")
    foreign = deployment.start("foreign", "client", "clients/silo-00.toml", "--name", "foreign",
                               "--root-certificates", "other-ca/ca.crt", "--runtime-port",
                               str(free_port()), "--ledger-path", "foreign.json",
                               "--rejoin-wait", "0")
    # An unregistered key, with the default --rejoin-wait: one refusal, and a verdict that
    # names the cause (the SuperLink tells it apart from a node of that key being online).
    started = time.monotonic()
    rogue = deployment.start("rogue", "client", "clients/silo-00.toml", "--name", "rogue",
                             "--auth-private-key", "certs/nodes/silo-04", "--runtime-port",
                             str(free_port()), "--ledger-path", "rogue.json")
    assert foreign.wait(timeout=180) != 0
    assert rogue.wait(timeout=180) == 1
    assert time.monotonic() - started < 90
    assert "SSL/TLS handshake error" in deployment.log("foreign")
    log = deployment.log("rogue")
    assert log.count("Failed to activate SuperNode") == 1 and "asking again" not in log
    assert log.strip().splitlines()[-1] == (
        "error: the SuperLink refused this silo: this SuperNode's public key is not registered "
        "with the SuperLink (or it was unregistered): its operator registers the silo's .pub "
        "file (`dpcfl server --register`, `flwr supernode register`)")
    assert not (root / "foreign.json").exists() and not (root / "rogue.json").exists()


@pytest.mark.slow
def test_a_second_instance_of_a_connected_silo_is_refused_quietly_with_one_verdict(
        deployment):
    # Another machine's copy of silo 2 (its own Flower home, so no memory of silo 2's
    # session): refused while silo 2 is online, asked again without the SuperNode's start-up
    # lines, and ended with one line saying why.
    root = deployment.root
    _wait_for(root / "silo-02.log", "SuperNode ID: ", deployment.processes["silo-02"], 180)
    with (root / "twin.log").open("w") as log:
        twin = subprocess.Popen(
            [*DPCFL, "client", "clients/silo-02.toml", "--name", "twin", "--runtime-port",
             str(free_port()), "--ledger-path", "twin.json", "--rejoin-wait", "8", *SPLIT],
            cwd=root, env={**deployment.env, "FLWR_HOME": str(root / "twin-home")},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert twin.wait(timeout=180) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(twin.pid, signal.SIGKILL)
        twin.wait()
    log = (root / "twin.log").read_text()
    assert log.count("Failed to activate SuperNode") == 1
    assert "asking again every 5 s for up to 8 s" in log
    verdict = log.strip().splitlines()[-1]
    assert verdict.startswith("error: the SuperLink refused this silo (asked ")
    assert "a SuperNode with this public key is online" in verdict
    assert not (root / "twin.json").exists()


@pytest.mark.slow
def test_a_silo_whose_supervisor_is_killed_leaves_no_process_behind(deployment):
    # What a hard kill of `dpcfl client` does (kill -9, an OOM kill): its SuperNode (which
    # answers the ClientApp's tasks itself), in a session of its own, gets the parent-death
    # signal and must end.
    supervisor = deployment.processes.pop("silo-00")
    deadline = time.monotonic() + 60
    while not (helpers := descendants(supervisor.pid)):
        assert time.monotonic() < deadline, "silo 0 did not start its SuperNode"
        time.sleep(0.5)
    os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    assert not _alive(helpers, grace=30)


def test_committed_compose_file_and_silo_files_match_the_generator():
    options = ComposeOptions(Topology.parse("3,6,6,6"), Topology.parse("1,2,2,2"))
    assert (REPO / "compose.yaml").read_text() == compose_yaml(options)
    for name, text in silo_files(Topology.parse("3,6,6,6")).items():
        assert (REPO / "clients" / f"{name}.toml").read_text() == text


def _named_volumes(service: dict) -> dict[str, str]:
    """A compose service's named volumes (bind mounts left out): name -> where, `:ro` kept."""
    named = {}
    for spec in service.get("volumes", []):
        source, _, target = spec.partition(":")
        if not source.startswith((".", "/", "$")):
            named[source] = target
    return named


def test_compose_mounts_each_silo_only_its_own_key_and_the_ca_key_in_the_cert_maker_only():
    options = ComposeOptions(Topology.parse("3,6,6,6"), Topology.parse("1,2,2,2"))
    services = yaml.safe_load(compose_yaml(options))["services"]
    holders = defaultdict(set)
    for name, service in services.items():
        for volume in _named_volumes(service):
            holders[volume].add(name)
    assert holders["certs"] == {"certs"}  # the CA key, the silos' private keys
    shares = ["ca-cert", "superlink-certs", *(f"silo-{i:02d}-certs" for i in range(21))]
    assert _named_volumes(services["certs"]) == {
        "certs": "/certs", **{share: f"/deliver/{share}" for share in shares}}
    silos = {name: match[1] for name in services
             if (match := re.fullmatch(r"(?:gpu-|laptop-)?(silo-\d\d)", name))}
    assert len(silos) == 21 + 21 + 7
    for name, silo in silos.items():
        service = services[name]
        assert _named_volumes(service) == {f"{silo}-certs": "/certs:ro",
                                           f"{name}-ledger": "/ledgers"}, name
        command = service["command"]
        assert command[command.index("--auth-private-key") + 1] == f"/certs/nodes/{silo}"
        assert command[command.index("--root-certificates") + 1] == "/certs/ca.crt"
        assert service["depends_on"]["certs"] == {
            "condition": "service_completed_successfully"}
    for i in range(21):  # a silo's key volume: the same party in every profile
        assert holders[f"silo-{i:02d}-certs"] == {"certs", *(
            name for name, silo in silos.items() if silo == f"silo-{i:02d}")}
    assert _named_volumes(services["superlink"]) == {"superlink-certs": "/certs:ro",
                                                     "superlink-state": "/state"}
    for runner in ("serverapp", "gpu-serverapp", "laptop-serverapp"):
        assert _named_volumes(services[runner]) == {"ca-cert": "/certs:ro"}


def _run_cert_maker(root: Path, service: dict) -> None:
    """The ``certs`` service's shell as compose hands it to ``sh -c``, run here: its volumes
    are directories under ``root``, and the files stay with whoever runs the test."""
    script = service["entrypoint"][-1].replace("$$", "$")  # compose's escape for `$`
    script = re.sub(r"HOME=\S+ setpriv( --\S+)+ ", "", script)
    script = script.replace(" -o dpcfl -g dpcfl", "")
    script = script.replace("/deliver/", f"{root}/deliver/").replace(" /certs", f" {root}/certs")
    for volume in _named_volumes(service).values():
        (root / volume.lstrip("/")).mkdir(parents=True, exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # .venv/bin/dpcfl
    done = subprocess.run(["sh", "-c", script], env={**os.environ, "PATH": path},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _files(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(f.relative_to(directory)): (f.read_bytes(), f.stat().st_mode & 0o777)
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_the_cert_maker_gives_each_party_only_its_share_and_keeps_the_keys(tmp_path):
    options = ComposeOptions(Topology.parse("3,6,6,6"), Topology.parse("1,2,2,2"))
    service = yaml.safe_load(compose_yaml(options))["services"]["certs"]
    _run_cert_maker(tmp_path, service)
    made = _files(tmp_path / "certs")
    assert "ca.key" in made
    delivered = {volume.name: _files(volume) for volume in (tmp_path / "deliver").iterdir()}
    public = {f"nodes/silo-{i:02d}.pub" for i in range(21)}
    assert set(delivered["ca-cert"]) == {"ca.crt"}
    assert set(delivered["superlink-certs"]) == {"ca.crt", "server.pem", "server.key", *public}
    for i in range(21):
        silo = f"silo-{i:02d}"
        assert set(delivered[f"{silo}-certs"]) == {"ca.crt", f"nodes/{silo}", f"nodes/{silo}.pub"}
    for share in delivered.values():
        for name, (data, mode) in share.items():
            assert (data, mode) == made[name], name  # the same bytes, private keys still 0600
    # started again (`docker compose up` after a stop): the CA and keys are kept
    _run_cert_maker(tmp_path, service)
    assert _files(tmp_path / "certs") == made
    assert {volume.name: _files(volume) for volume in (tmp_path / "deliver").iterdir()} == (
        delivered)


def test_docker_compose_accepts_the_compose_file():
    assert shutil.which("docker-compose"), "install Debian's docker-compose (scripts/setup.sh does)"
    for profile in ("cpu", "gpu", "laptop"):
        checked = subprocess.run(["docker-compose", "--profile", profile, "config", "-q"],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stderr
