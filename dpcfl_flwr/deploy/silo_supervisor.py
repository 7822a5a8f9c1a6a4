"""The lean process a silo's supervisor becomes once its checks are done: it runs the SuperNode,
starts it again while the SuperLink asks it to wait, and says where the run's models are.

``dpcfl client`` checks the silo file, the records and the ledger, and prints its plan; that
needs the settings' models, numpy and the console, ~75 MB resident that the supervisor would
hold for its silo's whole life (21 silos on one host: 1.5 GB for nothing). So it replaces
itself (``exec``: same pid, same signals and output) with
``python -m dpcfl_flwr.deploy.silo_supervisor`` and what it decided, which imports only this
module, the console and Flower's refusal words: ~20 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from ..flower_compat import KEY_NOT_REGISTERED, NODE_ONLINE
from ..silo.model_files import model_files
from .supervision import console, die_with_parent, errors, signalled, wait_passing_output

_MODULE = "dpcfl_flwr.deploy.silo_supervisor"


def supervise_lean(command: list[str], rejoin_wait: float, ledger_path: str) -> None:
    """Become the lean supervisor of ``command`` (the SuperNode's); never returns. Its exit
    code is the SuperNode's (:func:`supervise`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    plan = json.dumps({"command": command, "rejoin_wait": rejoin_wait,
                       "ledger_path": ledger_path})
    os.execv(sys.executable, [sys.executable, "-m", _MODULE, plan])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_MODULE, description=__doc__)
    parser.add_argument("plan", help="JSON: command, rejoin_wait (s), ledger_path")
    plan = json.loads(parser.parse_args(argv).plan)
    started = time.time()
    code = supervise(list(plan["command"]), float(plan["rejoin_wait"]))
    print_models(str(plan["ledger_path"]), started)
    return code


def print_models(ledger_path: str, since: float) -> None:
    """One line per model file this silo wrote while it ran (:mod:`dpcfl_flwr.silo.kept_model`):
    where its result is, once the SuperNode has ended."""
    written = [path for path in model_files(ledger_path) if path.stat().st_mtime >= since]
    if written:
        from . import silo_torch  # reads the files in a child of its own; only at the end

        silo_torch.print_models(written)


# What flower-supernode prints when the SuperLink refuses to start its session (it exits 1 for
# every error, so the message is what tells this case apart) and once it is activated.
_ACTIVATION_REFUSED = "Failed to activate SuperNode"
_ACTIVATED = "SuperNode ID: "
#: Why a SuperLink that does not say (not `dpcfl server`'s) may refuse a silo.
_LIKELY_REFUSALS = ("its public key is not registered with the SuperLink, or a session with "
                    "this key is open there (this silo runs elsewhere too, or a crashed "
                    "instance's session has not expired yet, ~60 s after its last heartbeat)")
#: Seconds between activation attempts while a node with this silo's key is online.
REJOIN_RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class _SuperNodeLife:
    code: int
    refusal: str | None  # why the SuperLink refused to activate the node, if it did
    stopped: bool  # by SIGINT / SIGTERM
    activated: bool = False  # the SuperLink started its session


def supervise(command: list[str], rejoin_wait: float) -> int:
    """Run the SuperNode, passing its output through. While the SuperLink refuses it because
    a node with this silo's key is online (another instance, or a crashed one's session the
    silo could not end itself), ask again every few seconds for ``rejoin_wait`` s, quietly: a
    line at the first refusal, a verdict if it lasts. A SuperNode that ends by itself after
    its session started lost its SuperLink (it restarted, with the run to resume): start it
    again for ``rejoin_wait`` s. An unregistered key, TLS failures and every other error end
    the silo at once, a refusal with one line saying why."""
    # rejoin_wait counts from the first refusal, not from the start: a SuperNode that takes
    # long to start on a busy host still gets its retries
    deadline = math.inf
    signalled.clear()
    attempts = 0
    lost = False
    while True:
        life = _run_supernode(command, quiet=attempts > 0)
        attempts += 1
        if life.stopped:
            return life.code
        if life.code == 0 and (life.activated or lost):
            if life.activated:
                console.print(f"the SuperNode lost its SuperLink; starting it again every "
                              f"{REJOIN_RETRY_SECONDS:g} s for up to {rejoin_wait:g} s (the "
                              "ledger goes on)", highlight=False, markup=False, soft_wrap=True)
                lost, deadline = True, time.monotonic() + rejoin_wait
            if time.monotonic() < deadline and not signalled.wait(REJOIN_RETRY_SECONDS):
                continue
            return life.code
        if life.code == 0 or life.refusal is None:
            return life.code
        if deadline == math.inf:
            deadline = time.monotonic() + rejoin_wait
        if KEY_NOT_REGISTERED in life.refusal or time.monotonic() >= deadline:
            waited = f" (asked {attempts} times in {rejoin_wait:g} s)" if attempts > 1 else ""
            errors.print(f"error: the SuperLink refused this silo{waited}: {life.refusal}",
                         highlight=False, markup=False)
            return life.code
        if attempts == 1:
            console.print(f"the SuperLink refused this silo: {life.refusal}; asking again "
                          f"every {REJOIN_RETRY_SECONDS:g} s for up to {rejoin_wait:g} s",
                          highlight=False, markup=False, soft_wrap=True)
        if signalled.wait(REJOIN_RETRY_SECONDS):  # Ctrl-C while waiting to retry: done
            return life.code


def _run_supernode(command: list[str], quiet: bool = False) -> _SuperNodeLife:
    """One SuperNode life. ``quiet``: its output is held until the SuperLink activates it and
    dropped if it refuses again (a retry's start-up lines say nothing new).

    The SuperNode runs in its own process group (a warm silo answers its ClientApp tasks in
    that process), dies with this supervisor (parent-death signal), and whatever it leaves
    behind (a SuperExec, a fresh ClientApp process) is killed when it exits: a stray helper
    would keep the output pipe open and hold this silo's runtime port.
    """
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True,
                               preexec_fn=die_with_parent)
    held: list[str] | None = [] if quiet else None
    refused: list[str] = []  # the refusal line, then the SuperLink's reason if it gave one

    activated = False

    def pump() -> None:
        nonlocal held, activated
        assert process.stdout is not None
        for line in process.stdout:
            activated = activated or _ACTIVATED in line
            if held is not None and _ACTIVATED in line:
                sys.stdout.writelines(held)
                held = None
            if refused or _ACTIVATION_REFUSED in line:
                refused.append(line)
            if held is None:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                held.append(line)

    code, stopped = wait_passing_output(process, pump)
    if held and not refused:  # it ended for another reason: that must be seen
        sys.stdout.writelines(held)
    return _SuperNodeLife(code, _refusal(refused) if refused else None, stopped, activated)


def _refusal(lines: list[str]) -> str:
    """The SuperLink's reason among a refused SuperNode's last lines (superlink_launcher's
    words), or the likely causes when it gave none."""
    for line in lines:
        for words in (KEY_NOT_REGISTERED, NODE_ONLINE):
            if words in line:
                return line[line.index(words):].strip()
    return _LIKELY_REFUSALS


__all__ = ["REJOIN_RETRY_SECONDS", "main", "print_models", "supervise", "supervise_lean"]

if __name__ == "__main__":
    sys.exit(main())
