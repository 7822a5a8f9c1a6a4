"""A deployed run whose SuperLink and ServerApp die mid-run, resumed with `dpcfl submit --resume`,
or by the `dpcfl submit --resume-on-restart` that submitted it.

The README's deployment on 127.0.0.1 (TLS, node keys, one `dpcfl client` per silo): once the
run has checkpointed round 2, the SuperLink is killed with everything under it (its ServerApp
too); the SuperLink is started again and the silos rejoin it by themselves. Either `dpcfl
submit` is killed too and an operator's `dpcfl submit --resume` finishes the run from its
checkpoint, or the first `dpcfl submit --resume-on-restart 1` waits for the SuperLink and does
so itself. Every silo keeps one noise plan across the Flower runs (the run key) and stays
within its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dpcfl_flwr.deploy.localhost import LocalDeployment
from dpcfl_flwr.privacy.ledger import PrivacyBudget, PrivacyLedger
from dpcfl_flwr.strategies.checkpoint import CHECKPOINT, read_checkpoint

DPCFL = [sys.executable, "-m", "dpcfl_flwr.cli"]
REPO = Path(__file__).resolve().parents[1]
ROUNDS = 6
RUN = {"method": '"global"', "clusters": '"1,2"', "samples-per-client": 64, "test-samples": 40,
       "num-server-rounds": ROUNDS, "eval-every": 3, "wait-for-clients": 120}


def _submit(deployment: LocalDeployment, log: str, *args: str) -> subprocess.Popen[str]:
    with (deployment.root / log).open("w") as handle:
        return subprocess.Popen(
            [*DPCFL, "submit", "--superlink", f"127.0.0.1:{deployment.api}",
             "--root-certificates", "certs/ca.crt", "--app", str(deployment.root), *args],
            cwd=deployment.root, env=deployment.env, stdout=handle, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)


def _checkpointed(path: Path) -> int:
    try:
        return read_checkpoint(path).round if path.exists() else 0
    except Exception:  # noqa: BLE001 - being replaced as we read: ask again
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("who", ["operator", "submit itself"])
def test_a_run_resumes_after_its_superlink_and_serverapp_died(tmp_path, who):
    deployment = LocalDeployment(tmp_path / "deployment", clusters="1,2")
    deployment.up("--in-memory")
    deployment.use_snapshot(REPO)  # one app for the silos and the FAB
    out = deployment.root / "run"
    settings = [arg for key, value in {**RUN, "out-dir": f'"{out}"'}.items()
                for arg in ("--set", f"{key}={value}")]
    try:
        for index in range(deployment.silos):
            deployment.silo(index, "--samples-per-client", "64", "--test-samples", "40")
        by_itself = who == "submit itself"
        first = _submit(deployment, "submit-1.log", *settings,
                        *(["--resume-on-restart", "1"] if by_itself else []))
        deadline = time.monotonic() + 300
        while _checkpointed(out / CHECKPOINT) < 2:
            assert time.monotonic() < deadline and first.poll() is None, (
                (deployment.root / "submit-1.log").read_text()[-3000:])
            time.sleep(0.1)
        deployment.kill("server")  # the SuperLink and the ServerApp it runs
        if not by_itself:
            first.kill()
            first.wait(timeout=30)
        died_after = _checkpointed(out / CHECKPOINT)
        assert died_after < ROUNDS
        deployment.restart_server()
        second = first if by_itself else _submit(deployment, "submit-2.log", "--resume",
                                                 str(out))
        second.wait(timeout=600)
        shown = (deployment.root / ("submit-1.log" if by_itself else "submit-2.log")).read_text()
        assert second.returncode == 0, shown[-3000:]
        if by_itself:
            assert "the SuperLink went away during the run" in shown
            assert shown.count("submitting ") == 2
    finally:
        deployment.down()
    results = json.loads((out / "results.json").read_text())
    assert results["complete"]
    assert [r["round"] for r in results["rounds"]] == list(range(1, ROUNDS + 1))
    budget = PrivacyBudget(10.0, 1e-4)
    for client in results["clients"]:
        ledger = PrivacyLedger.load(deployment.root / "ledgers" /
                                    f"silo-{client['partition']:02d}.json")
        assert ledger.spent(budget) <= 10.0 + 1e-9
        assert len(ledger.meta["runs"]) == 1  # one plan, kept by the run key
        # A round the silo had been charged for before the server died is skipped in the
        # resumed run, never charged again, and the silo trains the rounds after it.
        trained = Counter(e.round for e in ledger.entries if e.kind == "gaussian" and e.round
                          and e.noise_multiplier == ledger.entries[0].noise_multiplier)
        # one entry a round; the round that chose the learning rate one per candidate, once
        chose = [r for r, count in trained.items() if count > 1]
        assert len(chose) <= 1 and all(trained[r] == 4 for r in chose), trained
        assert not client["exhausted"] and not client["refused_rounds"], client
        assert ROUNDS not in client["dropped_rounds"]
    print(f"\nresumed after round {died_after}; final mean accuracy "
          f"{results['summary']['mean_accuracy']:.3f}")
