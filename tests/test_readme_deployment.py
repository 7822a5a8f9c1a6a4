"""README's real-silo commands, run as the README writes them, on 127.0.0.1 with TLS and node
authentication: `server/make-certs.sh`, `server/start-superlink.sh`, `dpcfl client
clients/silo-NN.toml` for four silos and `dpcfl submit`, end to end; then the SuperLink's
supervisor is killed (kill -9), the SuperLink must go with it, and the same command starts it
again (its state and the silos' keys kept) for a second run with the same silos.

The commands are read from README.md, in a copy of this checkout. What the test changes, and
only by adding flags (later flags win): the ports (free ones, not 8000 and 9092, which this
machine may be using) and a small run (four silos of topology {2,2}, 64 records each, three
rounds). The silos and `dpcfl submit` use one snapshot of the app: a silo refuses a FAB whose
code differs from its own, and this checkout may be edited while the test runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from dpcfl_flwr.deploy.localhost import free_port
from dpcfl_flwr.runs.processes import descendants
from tests.doc_commands import (
    REPO,
    Operator,
    code_blocks,
    copy_of_the_checkout,
    listening,
    only_command,
    section,
    shell_commands,
)

SILOS = 4
# half the budget per run: by default a run plans to spend all a silo has left, and the test
# runs twice (docs/privacy.md#runs-after-the-first)
SMALL_SILO = ["--clusters", "2,2", "--samples-per-client", "64", "--test-samples", "40",
              "--run-epsilon", "5"]
SMALL_RUN = ['clusters="2,2"', f"min-clients={SILOS}", "rdpcfl.n-clusters=2",
             "samples-per-client=64", "test-samples=40", "num-server-rounds=3", "eval-every=3",
             "wait-for-clients=300.0"]


def readme_commands() -> list[list[str]]:
    """The shell commands of README's "Real silos" section, in order (continued lines
    joined, comments dropped)."""
    blocks = code_blocks(section(REPO / "README.md", "Real silos"), "bash")
    return [command for block in blocks for command in shell_commands(block)]


def _command(commands: list[list[str]], *start: str) -> list[str]:
    return only_command(commands, *start, where="README's real-silo section")


@pytest.mark.slow
def test_readme_real_silo_commands_run_end_to_end_and_after_a_superlink_restart(tmp_path):
    commands = readme_commands()
    make_certs = _command(commands, "server/make-certs.sh")
    start_superlink = _command(commands, "server/start-superlink.sh")
    submit = _command(commands, ".venv/bin/dpcfl", "submit")
    client = _command(commands, ".venv/bin/dpcfl", "client")
    copy_of_the_checkout(tmp_path)
    operator = Operator(tmp_path)
    fleet, api = free_port(), free_port()
    ports = ["--fleet-address", f"0.0.0.0:{fleet}", "--api-address", f"127.0.0.1:{api}"]
    started = time.monotonic()
    try:
        made = operator.run("make-certs", make_certs, timeout=120)
        assert made.returncode == 0, made.stderr
        assert len(list((tmp_path / "certs" / "nodes").glob("silo-*.pub"))) == 21

        operator.start("superlink", [*start_superlink, *ports])
        operator.wait_for("superlink", "ready:", timeout=240)
        log = operator.log("superlink")
        assert "registered 21 silo key(s)" in log
        assert f"silos dial superlink.example.org:{fleet} or 127.0.0.1:{fleet}" in log
        # A second SuperLink on the same ports: refused before it starts, one line per port.
        second = operator.run("superlink-twice", [*start_superlink, *ports], timeout=120)
        assert second.returncode == 2
        assert [line for line in second.stderr.splitlines() if line.strip()] == [
            f"error: {flag} {address}: port {address.rpartition(':')[2]} is already in use by "
            f"pid {_holder(address)} {'(python -m dpcfl_flwr.deploy.superlink_launcher)'}; "
            "stop that process (a SuperLink left by a killed `dpcfl server`?) or choose "
            "another port" for flag, address in zip(ports[::2], ports[1::2], strict=True)]

        for i in range(SILOS):
            silo = [f"clients/silo-{i:02d}.toml" if a.startswith("clients/silo-") else a
                    for a in client]
            operator.start(f"silo-{i:02d}", [*silo, "--superlink", f"127.0.0.1:{fleet}",
                                             "--runtime-port", str(free_port()), *SMALL_SILO])
        for i in range(SILOS):  # connected (a silo that is not fails here, with its log)
            operator.wait_for(f"silo-{i:02d}", "SuperNode ID: ", timeout=300)
        first = _submitted(operator, submit, api, "run1")
        print(f"\nREADME deployment, first run: {time.monotonic() - started:.0f} s")

        # The SuperLink's supervisor killed outright: the SuperLink must end with it ...
        supervisor = operator.processes.pop("superlink")
        superlink = descendants(supervisor.pid)
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 30
        while listening(fleet) or listening(api):
            assert time.monotonic() < deadline, f"the SuperLink outlived it: {superlink}"
            time.sleep(0.5)
        # ... and the same command starts it again, on the kept state and keys.
        restarted = time.monotonic()
        operator.start("superlink", [*start_superlink, *ports])
        operator.wait_for("superlink", "ready:", timeout=240)
        assert "registered 0 silo key(s), 21 registered before" in operator.log("superlink")
        second_run = _submitted(operator, submit, api, "run2")
        print(f"README deployment, restart and second run: "
              f"{time.monotonic() - restarted:.0f} s")
    finally:
        operator.kill_all()
    for out, results in (("run1", first), ("run2", second_run)):
        said = "\n".join([line for line in operator.log(out).splitlines()
                          if "WARNING" in line or "ERROR" in line]
                         + [f"silo-{i:02d}: {line}" for i in range(SILOS)
                            for line in operator.log(f"silo-{i:02d}").splitlines()[-8:]])
        assert results["complete"] and len(results["clients"]) == SILOS, f"{out}:\n{said}"
        assert all(not c["dropped_rounds"] for c in results["clients"]), f"{out}:\n{said}"


def _holder(address: str) -> str:
    """The pid listening on ``address``'s port (from ss)."""
    listing = subprocess.run(["ss", "-Hltnp", f"sport = :{address.rpartition(':')[2]}"],
                             capture_output=True, text=True, check=False).stdout
    return re.findall(r"pid=(\d+)", listing)[0]


def _submitted(operator: Operator, submit: list[str], api: int, out: str) -> dict:
    """README's `dpcfl submit`, on this SuperLink's port, writing to ``out``; its results."""
    command = [a.replace("127.0.0.1:8000", f"127.0.0.1:{api}") for a in submit]
    command = [f'out-dir="{operator.root / out}"' if a.startswith("out-dir=") else a
               for a in command]
    for setting in SMALL_RUN:
        command += ["--set", setting]
    done = operator.run(out, command, timeout=900)
    assert done.returncode == 0, operator.log(out)
    return json.loads((operator.root / out / "results.json").read_text())
