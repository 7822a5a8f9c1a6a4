"""A silo's privacy against a malicious server, on real SuperNodes over gRPC (TLS, node
authentication, `flwr run`, as in tests/test_deployment.py): the server's FAB runs on a silo
only if it ships the app installed there, and a silo's budget and ledger are its own.

Two silos, one warm and one with a fresh flwr-clientapp per message. A FAB whose client_app.py
was changed (to stop recording spending in the ledger) is refused by both: one log line each,
Error replies the server logs, and none of its code runs. The untampered FAB runs on both. A
SuperNode started by hand, with Flower's own SuperExec and a node config without delta and
ledger path, answers with Errors naming them, and the server says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dpcfl_flwr.deploy.localhost import FLWR, LocalDeployment, free_port
from dpcfl_flwr.privacy.ledger import PrivacyLedger

REPO = Path(__file__).resolve().parents[1]
SMALL = {"rdpcfl.n-clusters": 2, "samples-per-client": 64, "test-samples": 40}
SPLIT = ["--samples-per-client", "64", "--test-samples", "40"]  # the silos' own, as the run's
MARKER = "tampered-code-ran"
# What the server's FAB adds to client_app.py: it stops the ledger from recording anything, and
# leaves a mark if it ever runs in a silo's process.
TAMPERING = f'''
import os as _os
import sys as _sys

from .privacy.ledger import PrivacyLedger as _Ledger

if any(part in " ".join(_sys.argv) for part in ("flwr-clientapp", "supernode")):
    open(_os.path.join(_os.environ["FLWR_HOME"], "{MARKER}"), "w").close()
    _Ledger.save = lambda self, *args, **kwargs: None
'''


def _wait_for(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout} s"
        time.sleep(0.5)


def _copy_app(root: Path) -> Path:
    """This checkout's app (what `flwr run` packs) as a Flower app directory ``root``."""
    shutil.copytree(REPO / "dpcfl_flwr", root / "dpcfl_flwr",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = LocalDeployment(tmp_path_factory.mktemp("pinning"), clusters="1,1")
    dep.up("--register", "certs/nodes/silo-02.pub")  # the spare key: the SuperNode by hand
    # The silos' installed app and the untampered FAB: one snapshot of this checkout, first on
    # the silos' path, so that an edit to the checkout during the test is not a FAB with other
    # code.
    dep.env["PYTHONPATH"] = str(_copy_app(dep.root))
    dep.silo(0, *SPLIT)
    dep.silo(1, *SPLIT, "--process-per-message")
    yield dep
    dep.down()


def _tampered_app(root: Path) -> Path:
    app = root / "tampered-app"
    shutil.copytree(root / "dpcfl_flwr", app / "dpcfl_flwr",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", app / "pyproject.toml")
    client_app = app / "dpcfl_flwr" / "client_app.py"
    client_app.write_text(client_app.read_text() + TAMPERING)
    return app


def _run(deployment: LocalDeployment, out: str, app: Path, timeout: float,
         **config: object) -> tuple[int, str]:
    run = deployment.flwr_run(out, app, **SMALL, **{"num-server-rounds": 2, "eval-every": 2,
                                                     **config})
    code = run.wait(timeout=timeout)
    return code, deployment.log(out)  # the ServerApp's log, streamed by `flwr run`


@pytest.mark.slow
def test_a_fab_with_other_code_is_refused_by_warm_and_per_message_silos(deployment):
    # FedAvg: R-DPCFL would stop before asking anyone (it needs more than two silos)
    _, server_log = _run(deployment, "tampered", _tampered_app(deployment.root), 600,
                         method='"global"', **{"wait-for-clients": 180.0})
    reason = "this silo refused FAB"
    why = "its dpcfl_flwr/client_app.py differs from the installed one"
    refusals = [line for line in server_log.splitlines()
                if "cannot start" in line and reason in line]
    assert len(refusals) == 2 and all(why in line for line in refusals), server_log[-3000:]
    for i in range(2):
        log = deployment.log(f"silo-{i:02d}")
        lines = [line for line in log.splitlines() if "refused FAB" in line]
        assert len(lines) == 1 and why in lines[0], log[-3000:]
        assert "message answered in this process" not in log
    assert not (Path(deployment.env["FLWR_HOME"]) / MARKER).exists()  # none of its code ran
    assert not list((deployment.root / "ledgers").iterdir())  # no silo's ClientApp was asked
    assert "0 of 2 silos can run (2 failed to start: this silo refused FAB" in server_log


@pytest.fixture(scope="module")
def by_hand(deployment):
    """`flower-supernode` as anyone can start it: Flower's SuperExec, and a node config that
    sets an epsilon but no delta and no ledger path."""
    root, bin_dir = deployment.root, Path(FLWR).parent
    log = (root / "by-hand.log").open("w")
    path = f"{bin_dir}:{deployment.env.get('PATH', '')}"  # Flower starts its SuperExec by name
    deployment.processes["by-hand"] = subprocess.Popen(
        [str(bin_dir / "flower-supernode"), "--superlink",
         f"127.0.0.1:{deployment.fleet}", "--root-certificates", "certs/ca.crt",
         "--auth-supernode-private-key", "certs/nodes/silo-02", "--port", str(free_port()),
         "--node-config", "partition-id=0 epsilon=4"],
        cwd=root, env={**deployment.env, "PATH": path}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    _wait_for(root / "by-hand.log", "SuperNode ID", timeout=120)
    return deployment


@pytest.fixture(scope="module")
def trusted_run(by_hand) -> tuple[int, str]:
    # the silos' own snapshot; FedAvg: R-DPCFL needs more than two silos to cluster
    return _run(by_hand, "trusted", by_hand.root, 900, method='"global"')


@pytest.mark.slow
def test_the_installed_app_runs_warm_and_one_process_per_message(by_hand, trusted_run):
    code, server_log = trusted_run
    results = json.loads((by_hand.root / "trusted" / "results.json").read_text())
    assert code == 0 and results["complete"], server_log[-3000:]
    assert sorted(c["partition"] for c in results["clients"]) == [0, 1]
    assert all(c["test_accuracy"] is not None and c["epsilon_spent"] > 0
               for c in results["clients"])
    warm, per_message = (by_hand.log(f"silo-{i:02d}") for i in range(2))
    assert "ships the installed app; its messages are answered in this process" in warm
    assert "message answered in this process" in warm
    assert "ships the installed app; its messages are answered by one process each" in (
        per_message)
    assert "message answered in this process" not in per_message
    for i in range(2):  # each silo's ledger, on its own disk, holds what it spent
        assert PrivacyLedger.load(by_hand.root / "ledgers" / f"silo-{i:02d}.json").entries


MISSING = "delta, ledger-path must be set in the silo's own node config"


@pytest.mark.slow
def test_a_supernode_without_delta_and_ledger_path_answers_with_errors_naming_them(
        by_hand, trusted_run):
    """The server learns that the silo's own settings cannot be used; which keys are missing
    is for the silo's operator, in its own log."""
    _, server_log = trusted_run
    lines = [line for line in server_log.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and "the silo's own settings" in lines[0], server_log[-3000:]
    assert MISSING not in server_log
    assert "Sending: query message" in by_hand.log("by-hand")  # its Error reply
    assert MISSING in by_hand.log("by-hand")


@pytest.mark.slow
def test_dpcfl_client_without_delta_and_ledger_path_starts_no_supernode(deployment):
    clients = deployment.root / "clients"
    text = (clients / "silo-00.toml").read_text()
    kept = [line for line in text.splitlines()
            if not line.startswith(("delta =", "ledger-path ="))]
    (clients / "no-budget.toml").write_text("\n".join(kept) + "\n")
    refused = subprocess.run(
        [str(Path(FLWR).parent / "dpcfl"), "client", "clients/no-budget.toml", "--name",
         "no-budget", "--runtime-port", str(free_port())], cwd=deployment.root,
        env=deployment.env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert [line for line in refused.stderr.splitlines() if line.strip()] == [
        f"error: node config: {MISSING} (silo file); a deployed silo never takes its budget or "
        "ledger from the server"]
    assert "flower-supernode" not in refused.stdout + refused.stderr
