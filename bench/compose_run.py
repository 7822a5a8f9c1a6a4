"""`docker compose` as an operator meets it, on a real Docker engine: the quick example with the
committed compose.yaml, a stack stopped mid-run and started again, a silo container killed and
the SuperLink restarted during a run.

  python bench/compose_run.py quick [--no-append]     # 21 silos, 30 rounds, as README says
  python bench/compose_run.py restarts [--tries 5] [--rounds 3] [--no-append]  # down, then up
  python bench/compose_run.py faults [--rounds 3] [--no-append]  # kill a silo, restart SuperLink

Each starts a Docker engine of its own and builds the image as tests/test_compose_engine.py does
(dpcfl_flwr/deploy/docker_engine.py; needs root), runs the stack with README's docker/up.sh in a
copy of compose.yaml and .env with an override that publishes no host ports (and, for the
small runs, sets the rounds), reads the silos' ledgers from their volumes, and removes the
project with its volumes at the end. `quick` refuses to start when the machine lacks the
memory its 21 silos need, and stops the stack if available memory runs low during the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, publish  # noqa: E402
from dpcfl_flwr.deploy.docker_engine import (  # noqa: E402
    CACHE,
    MemorySampler,
    build_image,
    compose_project,
    docker,
    engine_unavailable,
    private_engine,
    run_stack,
    volume_ledgers,
)
from dpcfl_flwr.privacy.ledger import PrivacyLedger  # noqa: E402

PROJECT = "dpcfl-compose-bench"
ROUND = re.compile(r"\[ROUND (\d+)/(\d+)\]")
DROPPED = "dropped a task of run"  # what a silo's runtime logs when it drops a stale task
REGISTERED = "SuperNode ID"  # what a silo's SuperNode logs once the SuperLink accepted it
#: What 21 silos, the SuperLink and the runner may take at their peak, plus room for the rest
#: of the machine; a run that would leave less is not started.
QUICK_NEEDS_GIB = 14.0
LOW_MEMORY_GIB = 1.5  # the stack is stopped if available memory falls below this


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


@dataclass
class Stack:
    """A compose project on the private engine: one profile, its runner service."""

    env: dict[str, str]
    directory: Path
    profile: str
    silos: int
    runner: str
    project: str = PROJECT
    events: list[str] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return "laptop-" if self.profile == "laptop" else ""

    def compose(self, *args: str, timeout: float = 900,
                check: bool = False) -> subprocess.CompletedProcess:
        done = subprocess.run(["docker", "compose", "-p", self.project, "--profile", self.profile,
                               *args], cwd=self.directory, env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def up(self, log: Path) -> subprocess.Popen:
        """README's command (``docker/up.sh <profile>``), its output to ``log``."""
        return run_stack(self.directory, self.profile, self.project, self.env, log)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", *services, timeout=120).stdout

    def round_under_way(self) -> int:
        """The round the runner's log last announced (0 before round 1)."""
        rounds = ROUND.findall(self.logs(self.runner))
        return int(rounds[-1][0]) if rounds else 0

    def silo_service(self, index: int) -> str:
        return f"{self.prefix}silo-{index:02d}"

    def ledgers(self) -> dict[str, PrivacyLedger]:
        return volume_ledgers(self.env, [f"{self.project}_{self.silo_service(i)}-ledger"
                                         for i in range(self.silos)])

    def results(self, name: str) -> dict:
        return json.loads((self.directory / "results" / "compose" / name / "results.json")
                          .read_text())

    def note(self, text: str) -> None:
        self.events.append(text)
        print(text, flush=True)


@contextmanager
def engine(socket: str | None) -> Iterator[dict[str, str]]:
    """The Docker engine at ``socket`` (one this script started in another run), or one of
    its own for the ``with`` block."""
    if socket:
        yield {**os.environ, "DOCKER_HOST": f"unix://{socket}",
               "DOCKER_CONFIG": str(CACHE / "config"), "DOCKER_BUILDKIT": "0"}
        return
    reason = engine_unavailable()
    if reason is not None:
        raise SystemExit(f"no Docker engine here: {reason}")
    with private_engine(CACHE) as env:
        yield env


@contextmanager
def stack(profile: str, settings: Sequence[str], socket: str | None = None,
          project: str = PROJECT) -> Iterator[Stack]:
    """A Docker engine with the image built, and a compose project of ``profile`` whose
    runner adds ``settings``; everything removed at the end (``down -v``)."""
    laptop = profile == "laptop"
    runner = "laptop-serverapp" if laptop else "serverapp"
    with engine(socket) as env, tempfile.TemporaryDirectory() as tmp:
        took, size = build_image(env, REPO, CACHE)
        print(f"image {size / 1e9:.2f} GB (built in {took:.0f} s)", flush=True)
        directory = compose_project(Path(tmp), REPO, runner, settings)
        deployed = Stack(env, directory, profile, 7 if laptop else 21, runner, project)
        deployed.image_bytes = size  # type: ignore[attr-defined]
        try:
            yield deployed
        finally:
            (CACHE / f"{project}.log").write_text(deployed.compose(
                "logs", "--no-color", "--timestamps", timeout=300).stdout)
            deployed.compose("down", "-v", "--remove-orphans", timeout=300)


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             every: float = 2) -> float:
    """Seconds until ``condition()`` held; raises if it did not within ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return time.monotonic() - started


def budgets(silos: int) -> dict[str, tuple[float, float]]:
    """Each committed silo file's (epsilon, delta)."""
    found = {}
    for i in range(silos):
        node = tomllib.loads((REPO / "clients" / f"silo-{i:02d}.toml").read_text())["node"]
        found[f"silo-{i:02d}"] = (node["epsilon"], node["delta"])
    return found


def spends(ledgers: dict[str, PrivacyLedger], silos: int) -> dict[str, tuple[float, float]]:
    """Each silo's (epsilon spent, epsilon budget), from its ledger and its silo file."""
    return {name: (ledgers[name].epsilon(delta), epsilon)
            for name, (epsilon, delta) in budgets(silos).items() if name in ledgers}


def rounds_counted_twice(ledger: PrivacyLedger) -> list[int]:
    """Rounds for which the ledger holds the same mechanism twice: a round charged twice.
    (A round's training and its private evaluation are two mechanisms: both Gaussian, with
    their own noise, rate and steps.)"""
    def mechanism(entry: object) -> tuple:
        return tuple(getattr(entry, name, None) for name in
                     ("round", "kind", "noise_multiplier", "sample_rate", "steps", "epsilon"))

    counts = Counter(mechanism(entry) for entry in ledger.entries if entry.round is not None)
    return sorted({key[0] for key, count in counts.items() if count > 1})  # type: ignore[misc]


# --------------------------------------------------------------------------- quick example


def quick(append: bool) -> None:
    free = available_gib()
    if free < QUICK_NEEDS_GIB:
        raise SystemExit(f"{free:.1f} GiB available: 21 silos need ~{QUICK_NEEDS_GIB:.0f} GiB "
                         "with room for the rest of the machine; not started")
    with stack("cpu", []) as deployed:
        sampler = MemorySampler(deployed.env)
        low: list[float] = []
        started = time.monotonic()
        load_before = load()
        before = least = available_gib()
        up = deployed.up(CACHE / "compose-quick.log")
        sampler.start()
        while up.poll() is None:
            time.sleep(5)
            least = min(least, available_gib())
            if least < LOW_MEMORY_GIB:
                low.append(least)
                deployed.compose("kill", timeout=120)
        took = time.monotonic() - started
        sampler.done.set()
        if low:
            raise SystemExit(f"stopped: available memory fell to {low[0]:.1f} GiB")
        results = deployed.results("cpu-run")
        spent = spends(deployed.ledgers(), deployed.silos)
        body = quick_table(up.returncode, took, results, spent, sampler, load_before,
                           deployed.image_bytes,  # type: ignore[attr-defined]
                           before - least)
    publish("docker compose: the quick example, 21 silos", body, append)


def quick_table(code: int, took: float, results: dict, spent: dict[str, tuple[float, float]],
                sampler: MemorySampler, load_before: str, image_bytes: int,
                host_gib: float) -> str:
    """``host_gib``: how far the machine's available memory fell below its value before
    ``up``, at the least seen (every 5 s): the stack's cost as the machine sees it, the
    engine's own share included, where the containers' sum adds figures sampled one after
    another. Run with nothing else on the machine, or it counts their growth too."""
    summary, clustering = results["summary"], results["clustering"]
    silos = {n: m for n, m in sampler.peak.items() if "silo-" in n}
    others = {n.removeprefix(f"{PROJECT}-"): m for n, m in sampler.peak.items()
              if "silo-" not in n}
    within = all(0 < s <= b for s, b in spent.values())
    rows = [
        ("exit code of `docker/up.sh`", f"{code}"),
        ("wall time, `docker/up.sh` to every container stopped",
         f"{took:.0f} s ({took / 60:.1f} min)"),
        ("run complete / silos evaluated",
         f"{results['complete']} / {summary.get('silos_evaluated')}"),
        ("round-1 ARI / final ARI / minority isolated",
         f"{clustering.get('ari', float('nan')):.2f} / "
         f"{clustering.get('final_ari', float('nan')):.2f} / "
         f"{clustering.get('minority_isolated')}"),
        ("mean / minority accuracy", f"{100 * summary['mean_accuracy']:.1f}% / "
                                     f"{100 * summary['minority_accuracy']:.1f}%"),
        ("epsilon spent (of 10 each)",
         f"{min(s for s, _ in spent.values()):.2f}-{max(s for s, _ in spent.values()):.2f} "
         f"over {len(spent)} ledgers, all within budget: {within}"),
        ("peak memory per silo container", f"{min(silos.values()):.0f}-"
                                           f"{max(silos.values()):.0f} MiB"),
        ("first sample per silo container (before round 1)",
         f"{min(sampler.first[n] for n in silos):.0f}-"
         f"{max(sampler.first[n] for n in silos):.0f} MiB"),
        ("peak memory, SuperLink / runner", " / ".join(f"{others.get(k, 0):.0f} MiB" for k in
                                                        ("superlink-1", "serverapp-1"))),
        ("peak of the containers' sum (sampled every 10 s)",
         f"{sampler.peak_total / 1024:.2f} GiB"),
        ("the machine's available memory, largest fall during the run",
         f"{host_gib:.2f} GiB"),
        ("image", f"{image_bytes / 1e9:.2f} GB"),
    ]
    table = "| what | figure |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    return (f"{table}\n\nLoad average {load_before} at the start (a niced benchmark queue "
            "shared the 2 cores).\n")


# --------------------------------------------------------------------------- down, then up


def restarts(tries: int, rounds: int, append: bool, socket: str | None) -> None:
    """``tries`` times: ``up -d``, ``down`` at a varied point of the run, ``up`` again with a
    timeout; the ledger volumes are dropped after each try (a try spends a silo's budget)."""
    # (round, seconds after the runner announced it): early and late in round 1 (the
    # clustering round, on the full batch) and in later rounds
    stops = [(1, 3.0), (2, 2.0), (1, 15.0), (rounds, 1.0), (2, 8.0)]
    settings = [f"num-server-rounds={rounds}", f"eval-every={rounds}"]
    lines = []
    with stack("laptop", settings, socket) as deployed:
        for attempt in range(tries):
            stop_round, after = stops[attempt % len(stops)]
            lines.append(one_restart(deployed, attempt + 1, stop_round, after, rounds))
            deployed.compose("down", timeout=300, check=True)
            for i in range(deployed.silos):
                docker(deployed.env, "volume", "rm",
                       f"{deployed.project}_{deployed.silo_service(i)}-ledger")
    body = ("| try | stopped | `down` took | new run: exit | took | dropped stale tasks | "
            "results in |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines))
    publish("docker compose: down mid-run, then up (laptop profile)", body, append)


def one_restart(deployed: Stack, attempt: int, stop_round: int, after: float,
                rounds: int) -> str:
    deployed.compose("up", "-d", timeout=600, check=True)
    wait_for(lambda: deployed.round_under_way() >= stop_round, 900,
             f"round {stop_round} of try {attempt}")
    time.sleep(after)
    stopped_in = deployed.round_under_way()
    started = time.monotonic()
    deployed.compose("down", timeout=300, check=True)
    down_took = time.monotonic() - started
    started = time.monotonic()
    log = CACHE / f"compose-restart-{attempt}.log"
    up = deployed.up(log)
    try:
        code, took = str(up.wait(timeout=1200)), time.monotonic() - started
        dropped = log.read_text(errors="replace").count(DROPPED)
    except subprocess.TimeoutExpired:
        up.terminate()  # docker/up.sh stops the stack
        up.wait(timeout=300)
        code, took, dropped = "hung (stopped after 1200 s)", time.monotonic() - started, -1
    written = sorted((p for p in (deployed.directory / "results" / "compose").iterdir()
                      if (p / "results.json").is_file()),
                     key=lambda p: (p / "results.json").stat().st_mtime)
    complete = bool(written) and json.loads((written[-1] / "results.json").read_text()).get(
        "complete", False)
    line = (f"| {attempt} | round {stopped_in} of {rounds}, {after:.0f} s after it began | "
            f"{down_took:.0f} s | {code} | {took:.0f} s | {dropped} | "
            f"{written[-1].name if written else 'none'} (complete: {complete}) |")
    deployed.note(line)
    return line


# --------------------------------------------------------------------------- faults


def faults(rounds: int, append: bool, socket: str | None, parts: str = "silo,superlink") -> None:
    settings = [f"num-server-rounds={rounds}", f"eval-every={rounds}"]
    lines: list[str] = []
    with stack("laptop", settings, socket, f"{PROJECT}-faults") as deployed:
        lines += [idle_memory(deployed), ""]
        if "silo" in parts:
            lines.append(killed_silo(deployed, rounds))
            deployed.compose("down", "-v", timeout=300, check=True)
            shutil.rmtree(deployed.directory / "results" / "compose")  # the next: laptop-run
        if "superlink" in parts:
            lines += restarted_superlink(deployed, rounds)
    body = "\n".join([*lines, "", *deployed.events])
    publish("docker compose: a silo killed, the SuperLink restarted (laptop profile)", body,
            append)


def idle_memory(deployed: Stack) -> str:
    """Memory of 7 registered silos with no run (the runner not started)."""
    services = ["superlink", *(deployed.silo_service(i) for i in range(deployed.silos))]
    deployed.compose("up", "-d", *services, timeout=600, check=True)
    wait_for(lambda: deployed.logs(*services[1:]).count(REGISTERED) >= deployed.silos, 900,
             "7 silos registered", every=5)
    time.sleep(20)
    sampler = MemorySampler(deployed.env)
    now = sampler.sample()
    mine = f"{deployed.project}-{deployed.prefix}silo-"
    silos = [m for n, m in now.items() if n.startswith(mine)]
    deployed.compose("stop", timeout=300)
    return (f"Idle (7 registered silos, no run): {min(silos):.0f}-{max(silos):.0f} MiB per "
            f"silo container, SuperLink {now.get(f'{deployed.project}-superlink-1', 0):.0f} MiB.")


def killed_silo(deployed: Stack, rounds: int, victim: int = 3) -> str:
    service = deployed.silo_service(victim)
    container = f"{deployed.project}-{service}-1"
    started = time.monotonic()
    up = deployed.up(CACHE / "compose-silo-kill.log")
    wait_for(lambda: deployed.round_under_way() >= 2, 900, "round 2")
    wait_for(lambda: holds_a_message(deployed.logs(service)), 900,
             f"silo {victim} holding a message", every=0.2)
    killed_in = deployed.round_under_way()
    registered = deployed.logs(service).count(REGISTERED)  # the container's log keeps lives
    docker(deployed.env, "kill", container)
    deployed.note(f"silo {victim}: `docker kill` in round {killed_in}")
    time.sleep(5)
    docker(deployed.env, "start", container)
    rejoined = wait_for(lambda: deployed.logs(service).count(REGISTERED) > registered, 300,
                        "the killed silo rejoined")
    deployed.note(f"silo {victim}: started 5 s after the kill, registered again "
                  f"{rejoined:.0f} s later (round {deployed.round_under_way()} under way)")
    up.wait(timeout=1800)
    took = time.monotonic() - started
    results = deployed.results("laptop-run")
    client = next(c for c in results["clients"] if c["partition"] == victim)
    said = [line.split("strategy: ", 1)[-1].split("silos: ", 1)[-1]
            for line in (CACHE / "compose-silo-kill.log").read_text().splitlines()
            if f"round {killed_in}" in line and f"silo {victim}" in line
            or f"round {killed_in} [" in line]
    twice = {n: r for n, r in ((n, rounds_counted_twice(lg)) for n, lg in
                               deployed.ledgers().items()) if r}
    return (f"A silo killed (`docker kill` of silo {victim} in round {killed_in} of {rounds}, "
            f"`docker start` 5 s later): the run went on, `docker/up.sh` exited "
            f"{up.returncode} after {took:.0f} s, complete {results['complete']}, the killed "
            f"silo evaluated in round {client['evaluated_round']}, dropped rounds "
            f"{client['dropped_rounds']}; rounds counted twice in a ledger: {twice or 'none'}. "
            f"The runner's log of round {killed_in}: " + " / ".join(said))


def holds_a_message(log: str) -> bool:
    """Whether a silo's log (its SuperNode's and its runtime's lines, every life of the
    container) shows a message received and not yet answered."""
    return log.count("Receiving: ") > log.count("message answered in this process")


def restarted_superlink(deployed: Stack, rounds: int) -> list[str]:
    """`docker compose restart superlink` in round 2; if that ends the run, the resume an
    operator runs (docs/deployment.md): `docker compose run` of the runner with
    ``dpcfl submit --resume``."""
    started = time.monotonic()
    log = CACHE / "compose-superlink-restart.log"
    up = deployed.up(log)
    wait_for(lambda: deployed.round_under_way() >= 2, 900, "round 2")
    time.sleep(2)
    restarted_in = deployed.round_under_way()
    deployed.compose("restart", "superlink", timeout=300)
    deployed.note(f"SuperLink: `docker compose restart superlink` in round {restarted_in}, "
                  f"done {time.monotonic() - started:.0f} s after `up`")
    try:
        code = str(up.wait(timeout=1200))
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()
        code = "none: still running after 1200 s"
    took = time.monotonic() - started
    runner_tail = [line for line in log.read_text().splitlines() if deployed.runner in line][-4:]
    lines = [f"The SuperLink restarted in round {restarted_in} of {rounds}: `docker/up.sh` "
             f"exited {code} after {took:.0f} s. The runner's last lines:", "", "```",
             *runner_tail, "```", ""]
    results = deployed.directory / "results" / "compose" / "laptop-run" / "results.json"
    if not (results.is_file() and json.loads(results.read_text()).get("complete")):
        lines.append(resumed(deployed))
    twice = {n: r for n, r in ((n, rounds_counted_twice(lg)) for n, lg in
                               deployed.ledgers().items()) if r}
    spent = spends(deployed.ledgers(), deployed.silos)
    lines.append(f"Rounds charged twice in a ledger: {twice or 'none'}; epsilon spent "
                 f"{min(s for s, _ in spent.values()):.2f}-{max(s for s, _ in spent.values()):.2f}"
                 f" of 10, all within budget: {all(s <= b for s, b in spent.values())}.")
    return lines


def resumed(deployed: Stack) -> str:
    started = time.monotonic()
    done = deployed.compose("run", "--rm", deployed.runner, "dpcfl", "submit", "--superlink",
                            "superlink:8000", "--root-certificates", "/certs/ca.crt", "--app",
                            "/app", "--resume", "/results/laptop-run", timeout=1500)
    took = time.monotonic() - started
    (CACHE / "compose-resume.log").write_text(done.stdout + done.stderr)
    deployed.compose("stop", timeout=300)
    try:
        results = deployed.results("laptop-run")
    except FileNotFoundError:
        results = {"complete": False, "summary": {}}
    return (f"Resumed with `docker compose --profile laptop run --rm laptop-serverapp dpcfl "
            f"submit ... --resume /results/laptop-run`: exit {done.returncode} after "
            f"{took:.0f} s, complete {results['complete']}, silos evaluated "
            f"{results['summary'].get('silos_evaluated')}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["quick", "restarts", "faults"])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--faults", default="silo,superlink",
                        help="which faults (silo, superlink; comma-separated)")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--engine", metavar="SOCKET",
                        help="use the Docker engine at this unix socket (one started by "
                             "another run of this script) instead of starting one")
    args = parser.parse_args()
    if args.what == "quick":
        quick(not args.no_append)
    elif args.what == "restarts":
        restarts(args.tries, args.rounds, not args.no_append, args.engine)
    else:
        faults(args.rounds, not args.no_append, args.engine, args.faults)


if __name__ == "__main__":
    main()
