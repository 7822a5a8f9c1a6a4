"""What a deployment costs while it waits: CPU by process role with no run under way.

Every silo of a gRPC deployment keeps two processes (supervisor, and the SuperNode that also
holds the warm ClientApp) that poll and tick while idle, and the SuperLink answers the
SuperNodes' polls. On a machine that hosts many silos, as the overhead benchmark's 21 silos
on 2 cores, that floor is paid during every round too: this measures it alone. The
deployment is the one of bench/overhead.py (TLS, node authentication, warm ClientApps); the
SuperNodes' idle poll is the knob that trades this floor against the latency with which a
round reaches an idle silo.

  python bench/idle_deployment.py [--clusters 3,6,6,6] [--idle-poll S] [--window 30]
                                  [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from bench.process_cpu import DRIVER, SAMPLER, ProcessCpuSampler  # noqa: E402
from dpcfl_flwr.deploy.localhost import LocalDeployment  # noqa: E402

CORES = 2
REGISTERED = "SuperNode ID"  # what a SuperNode prints once the SuperLink has accepted it


def wait_until_registered(deployment: LocalDeployment, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for i in range(deployment.silos):
        while REGISTERED not in deployment.log(f"silo-{i:02d}"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"silo {i} did not register:\n{deployment.log(f'silo-{i:02d}')}")
            time.sleep(1)


def measure(clusters: str, idle_poll: float, settle: float, window: float) -> dict[str, float]:
    """CPU seconds by role over ``window`` s, once every silo is registered and ``settle`` s
    have let the start-up (imports, data loading) finish."""
    with tempfile.TemporaryDirectory() as tmp:
        deployment = LocalDeployment(Path(tmp) / "idle", clusters=clusters)
        try:
            with ProcessCpuSampler(interval=1.0) as sampler:
                deployment.up("--in-memory")
                for i in range(deployment.silos):
                    deployment.silo(i, "--idle-poll", str(idle_poll))
                wait_until_registered(deployment)
                time.sleep(settle)
                start = time.time()
                time.sleep(window)
                end = time.time()
                time.sleep(1.5 * sampler.interval)  # a sample after the window's end
            by_role = sampler.cpu_between(start, end)
        finally:
            deployment.down()
    by_role.pop(DRIVER, None)  # this script sleeping
    by_role.pop(SAMPLER, None)  # and its measuring
    return by_role


def table(by_role: dict[str, float], silos: int, window: float) -> str:
    lines = ["| process role | CPU (s) | share of the machine | ms of CPU per silo per s |",
             "|---|---|---|---|"]
    for role, seconds in sorted(by_role.items(), key=lambda item: -item[1]):
        lines.append(f"| {role} | {seconds:.2f} | {100 * seconds / (CORES * window):.1f}% | "
                     f"{1000 * seconds / (silos * window):.2f} |")
    total = sum(by_role.values())
    lines.append(f"| all | {total:.2f} | {100 * total / (CORES * window):.1f}% | "
                 f"{1000 * total / (silos * window):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", default="3,6,6,6")
    parser.add_argument("--idle-poll", type=float, default=0.5)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    silos = sum(int(c) for c in args.clusters.split(","))
    by_role = measure(args.clusters, args.idle_poll, args.settle, args.window)
    body = (f"{silos} idle silos (clusters {args.clusters}), SuperNode idle poll "
            f"{args.idle_poll:g} s, CPU over {args.window:g} s on {CORES} cores\n\n"
            + table(by_role, silos, args.window))
    publish("Idle deployment: CPU by process role", body, append=not args.no_append)


if __name__ == "__main__":
    main()
