"""``dpcfl certs``, ``dpcfl server``, ``dpcfl client`` and ``dpcfl topology``: real silos.

Each command checks everything it can before it starts anything, prints what it will do, and
then hands over to Flower's own ``flower-superlink`` / ``flower-supernode``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import app_pin
from ..config import ConfigError, SiloConfig
from ..data import Topology
from ..flower_compat import KEY_NOT_REGISTERED, NODE_ONLINE
from ..flower_compat.environment import flower_tool, use_this_environment
from ..simulation import _toml_value
from .certs import make_certificates
from .compose import ComposeOptions, compose_yaml, silo_files
from .runs import StreamWatch, final_status, follow_hint
from .silo_file import check_silo, deployed_settings, load_silo_file, supernode_command
from .superlink import (
    DEFAULT_PULL_HOLD,
    ServerSettings,
    check_server,
    dial_addresses,
    listen_problems,
    register_keys,
    superlink_command,
    wait_until_listening,
    write_connection,
)

console = Console()
errors = Console(stderr=True, soft_wrap=True)
topology_app = typer.Typer(help="Deployment topologies.", no_args_is_help=True)


def _stop(problems: list[str]) -> None:
    for problem in problems:
        errors.print(f"[bold red]error:[/] {problem}", highlight=False)
    raise typer.Exit(code=2)


def certs(
    out: Path = typer.Option(Path("certs"), "--out", help="Directory for the files."),
    san: list[str] = typer.Option(None, "--san", help="Name or IP the silos dial (repeat)."),
    nodes: int = typer.Option(0, "--nodes", min=0, help="Node key pairs silo-00 .. silo-NN."),
    node_name: list[str] = typer.Option(None, "--node-name", help="Named node key pairs."),
    overwrite: bool = typer.Option(
        False, "--overwrite",
        help="Replace existing files: a new CA, SuperLink certificate and node keys (every "
             "silo then needs the new ca.crt and its new key pair)."),
    keep: bool = typer.Option(False, "--keep", help="Succeed without change if a CA exists."),
) -> None:
    """Make a CA, the SuperLink certificate and the silos' node-authentication keys."""
    names = list(node_name or []) + [f"silo-{i:02d}" for i in range(nodes)]
    if keep and (out / "ca.crt").exists():
        console.print(f"kept the existing certificates in {out}")
        return
    try:
        paths = make_certificates(out, san or ["localhost", "127.0.0.1", "::1"], names,
                                  overwrite)
    except (ValueError, FileExistsError) as exc:
        _stop([str(exc)])
        return
    console.print(f"CA: {paths.ca_certificate} (give it to every silo; keep {paths.ca_key} "
                  f"offline)\nSuperLink: {paths.server_certificate}, {paths.server_key}\n"
                  f"node keys: {len(names)} in {out / 'nodes'} (the .pub files are "
                  "registered with `dpcfl server --register`)")


def server(
    certs_dir: Path = typer.Option(None, "--certs", help="From `dpcfl certs`."),
    insecure: bool = typer.Option(False, "--insecure", help="No TLS (local experiments only)."),
    no_node_auth: bool = typer.Option(False, "--no-node-auth",
                                      help="Admit any SuperNode (no key registration)."),
    fleet: str = typer.Option("0.0.0.0:9092", "--fleet-address", help="gRPC for silos."),
    api: str = typer.Option("127.0.0.1:8000", "--api-address", help="HTTP for `flwr run`."),
    state: Path = typer.Option(Path("state"), "--state", help="SuperLink database directory."),
    in_memory: bool = typer.Option(False, "--in-memory",
                                   help="Keep SuperLink state in memory (lost on restart)."),
    connection: str = typer.Option("dpcfl", "--connection", help="Name for `flwr run . NAME`."),
    pull_hold: float = typer.Option(
        DEFAULT_PULL_HOLD, "--pull-hold",
        help="Seconds an idle silo's poll may wait for work (0: answer at once)."),
    register: list[Path] = typer.Option(None, "--register", help="Silo public keys to admit."),
    ready_file: Path = typer.Option(None, "--ready-file",
                                    help="Created once keys are registered (health checks)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and print, start nothing."),
) -> None:
    """Start the SuperLink (TLS and node authentication on unless --insecure)."""
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    settings = ServerSettings(certs_dir, insecure, not (no_node_auth or insecure), fleet, api,
                              state, connection, register=list(register or []),
                              in_memory=in_memory, pull_hold=pull_hold)
    _stop_if(check_server(settings) + listen_problems(settings))
    command = superlink_command(settings)
    _print_plan("SuperLink", {
        "fleet API (silos, gRPC)": fleet, "control API (flwr run)": api,
        "TLS": "off (insecure)" if insecure else f"on ({certs_dir})",
        "node authentication": "on" if settings.node_auth else "off",
        "idle silo polls held": f"up to {pull_hold:g} s" if pull_hold else "no",
        "keys to register": str(len(settings.register)), "state": settings.database,
        "flwr connection": f"{connection} in {settings.flwr_home / 'config.toml'}",
        "command": " ".join(command)})
    if dry_run:
        return
    state.mkdir(parents=True, exist_ok=True)
    write_connection(settings)
    use_this_environment()
    # A process group of its own (a terminal's Ctrl-C reaches it once, from here) that ends
    # with this supervisor, even when it is killed (parent-death signal): an orphaned
    # SuperLink would hold the ports the next `dpcfl server` needs.
    process = subprocess.Popen(command, process_group=0, preexec_fn=_die_with_parent)
    _forward_signals(process, group=True, grace=SUPERLINK_STOP_GRACE_SECONDS)
    try:
        _bring_up(settings, process)
        if ready_file is not None:
            ready_file.touch()
        code = process.wait()
    finally:
        _end_group(process, SUPERLINK_STOP_GRACE_SECONDS)
    raise typer.Exit(code=code)


#: How long a SuperLink may take to end after SIGTERM before it is killed.
SUPERLINK_STOP_GRACE_SECONDS = 10.0


def _bring_up(settings: ServerSettings, process: subprocess.Popen) -> None:
    """Wait until the SuperLink listens, register the silos' keys (a key registered before
    is left as it is) and say what silos dial; stop with one line on any failure."""
    def alive() -> bool:
        return process.poll() is None

    for address in (settings.api_address, settings.fleet_address):
        if not wait_until_listening(address, 60, alive):
            _stop([f"the SuperLink exited with code {process.returncode} before it listened "
                   "(see its log above)" if not alive() else
                   f"the SuperLink did not listen on {address} within 60 s"])
    if settings.register:
        done = register_keys(settings, settings.register)
        _stop_if(done.failures)
        console.print(f"registered {len(done.registered)} silo key(s)"
                      + (f", {len(done.already)} registered before" if done.already else ""))
    console.print(f"ready: silos dial {' or '.join(dial_addresses(settings))}; "
                  f"run with `flwr run . {settings.connection}`", highlight=False,
                  soft_wrap=True)


def _end_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM ``process``'s group, SIGKILL it after ``grace`` s (anything left in it too)."""
    with contextlib.suppress(ProcessLookupError):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def submit(
    superlink: str = typer.Option(
        "127.0.0.1:8000", "--superlink",
        help="The SuperLink's control API host:port (`dpcfl server --api-address`, port "
             "8000), not the Fleet API port silos dial (9092)."),
    root_certificates: Path = typer.Option(
        None, "--root-certificates", exists=True,
        help="The CA certificate the SuperLink's certificate must chain to (certs/ca.crt)."),
    insecure: bool = typer.Option(False, "--insecure",
                                  help="No TLS (a SuperLink started with --insecure)."),
    app_dir: Path = typer.Option(Path("."), "--app", help="The Flower app to run."),
    config: Path = typer.Option(None, "--config", exists=True, dir_okay=False,
                                help="TOML file of run-config keys (see examples/)."),
    overrides: list[str] = typer.Option(None, "--set",
                                        help="Override a run-config key: --set epsilon=5."),
    stream: bool = typer.Option(
        True, "--stream/--no-stream",
        help="Follow the run's log until it ends and exit with its outcome (1 if it failed); "
             "--no-stream: return once it has started."),
) -> None:
    """Submit a run to a SuperLink (`flwr run` with a validated run config)."""
    from ..simulation import load_config, parse_override

    if not insecure and root_certificates is None:
        _stop(["TLS needs --root-certificates (or --insecure for local experiments)"])
    try:
        experiment = load_config(config, dict(parse_override(o) for o in overrides or []))
    except (ValueError, OSError) as exc:
        _stop([str(exc)])
        return
    undeclared = _undeclared_keys(app_dir, experiment.to_run_config())
    if undeclared:  # Flower would refuse the run with "Invalid run configuration" only
        _stop([f"the app in {app_dir} does not declare the run-config key(s) "
               f"{', '.join(undeclared)} in \\[tool.flwr.app.config] of its pyproject.toml "
               "(is it another version of dpcfl-flwr?)"])
    settings = ServerSettings(insecure=insecure, api_address=superlink,
                              connection=SUBMIT_CONNECTION)
    settings.certs = None if root_certificates is None else root_certificates.parent
    home = write_connection(settings, root_certificates).parent
    run_config = home / "dpcfl-run-config.toml"
    run_config.write_text("".join(f"{k} = {_toml_value(v)}\n"
                                  for k, v in experiment.to_run_config().items()))
    command = [flower_tool("flwr") or "flwr", "run", str(app_dir), SUBMIT_CONNECTION,
               "--run-config", str(run_config)]
    if stream:
        command.append("--stream")
    console.print(f"submitting {experiment.method} (E={experiment.num_server_rounds}, "
                  f"{experiment.expected_clients} silos) to {superlink}")
    os.environ.setdefault("FLWR_HOME", str(home))
    use_this_environment()
    code, watch, stopped = _follow(command)
    hint = follow_hint(watch.run_id, SUBMIT_CONNECTION, Path(os.environ["FLWR_HOME"]))
    run = "the run" if watch.run_id is None else f"run {watch.run_id}"
    if stopped:
        errors.print(f"stopped following {run}; it goes on on the SuperLink ({hint})"
                     if watch.run_id is not None else "stopped before the SuperLink said it "
                     f"started the run; it may have ({hint})", highlight=False, markup=False)
        raise typer.Exit(code=128 + signal.SIGINT)
    if code != 0 or watch.run_id is None:
        raise typer.Exit(code=code or 1)  # `flwr run` has said why
    if not stream:
        console.print(f"{run} started ({hint})", highlight=False, markup=False)
        raise typer.Exit(code=0)
    _end_with_outcome(watch)


#: The Flower connection `dpcfl submit` writes into $FLWR_HOME/config.toml and runs with.
SUBMIT_CONNECTION = "dpcfl-submit"


def _follow(command: list[str]) -> tuple[int, StreamWatch, bool]:
    """Run ``flwr run``, passing its output through while watching it for the run id and the
    ServerApp's error line: (exit code, what was seen, stopped by Ctrl-C / SIGTERM)."""
    # A child in a process group of its own, so a terminal's Ctrl-C reaches it once, from here;
    # no stdin: in a background group a read would stop it instead of failing. Unbuffered: its
    # output is a pipe, and the log stream must reach the terminal as it comes.
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               text=True, bufsize=1, process_group=0,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=_die_with_parent)
    watch = StreamWatch()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            watch.see(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = _forward_signals(process, group=True, grace=STOP_GRACE_SECONDS)
    code = process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # anything it left in its group
    reader.join(timeout=5)
    return code, watch, stopped()


def _end_with_outcome(watch: StreamWatch) -> None:
    """Exit 0 if the followed run completed; otherwise 1, its one error line last."""
    assert watch.run_id is not None
    status = final_status(flower_tool("flwr") or "flwr", SUBMIT_CONNECTION, watch.run_id,
                          os.environ)
    hint = follow_hint(watch.run_id, SUBMIT_CONNECTION, Path(os.environ["FLWR_HOME"]))
    if status is None or not status.finished:
        errors.print(f"[bold red]error:[/] the log stream of run {watch.run_id} ended but the "
                     f"SuperLink does not say the run finished "
                     f"({'no answer' if status is None else status.status}); "
                     f"{escape(hint)}", highlight=False)
        raise typer.Exit(code=1)
    failure = status.failure(watch.app_error)
    if failure is not None:
        errors.print(f"[bold red]error:[/] run {watch.run_id} failed: {escape(failure)}",
                     highlight=False)
        raise typer.Exit(code=1)
    console.print(f"run {watch.run_id} completed", highlight=False)


def _undeclared_keys(app_dir: Path, run_config: dict[str, object]) -> list[str]:
    """The keys of ``run_config`` that the app's ``[tool.flwr.app.config]`` lacks."""
    try:
        with (app_dir / "pyproject.toml").open("rb") as handle:
            declared = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []  # not an app Flower can run either: `flwr run` says why
    return sorted(set(run_config) - set(declared))


def client(
    silo_file: Path = typer.Argument(None, exists=True, dir_okay=False,
                                     help="clients/<name>.toml (flags override it)."),
    name: str = typer.Option(None, "--name", help="The silo's name in its plan and logs."),
    superlink: str = typer.Option(
        None, "--superlink",
        help="The SuperLink's Fleet API host:port (`dpcfl server --fleet-address`, port "
             "9092), not the control API port `dpcfl submit` uses (8000)."),
    root_certificates: Path = typer.Option(
        None, "--root-certificates",
        help="The CA certificate the SuperLink's certificate must chain to (ca.crt)."),
    auth_private_key: Path = typer.Option(
        None, "--auth-private-key",
        help="This silo's node key (certs/nodes/silo-NN), its public half registered with "
             "the SuperLink."),
    insecure: bool = typer.Option(None, "--insecure/--tls",
                                  help="Default: TLS; --insecure for local experiments."),
    warm: bool = typer.Option(
        None, "--warm/--process-per-message",
        help="Default: warm, the SuperNode's own process answers all messages with one "
             "loaded ClientApp; --process-per-message: a fresh flwr-clientapp for each. "
             "Either way only for a FAB that ships the app installed here."),
    runtime_port: int = typer.Option(
        None, "--runtime-port",
        help="Local port of this silo's ClientApp runtime (default 9094); each silo on a "
             "host needs its own."),
    idle_poll: float = typer.Option(
        None, "--idle-poll",
        help="Seconds between SuperLink polls when idle (default 0.5; Flower's own: 3)."),
    partition_id: int = typer.Option(
        None, "--partition-id",
        help="Which client of the topology this silo is (0-based): its records and cluster."),
    epsilon: float = typer.Option(None, "--epsilon", help="Required (file or flag)."),
    delta: float = typer.Option(None, "--delta", help="Required (file or flag)."),
    ledger_path: Path = typer.Option(None, "--ledger-path", help="Required (file or flag)."),
    data_dir: Path = typer.Option(None, "--data-dir",
                                  help="Dataset directory (Fashion-MNIST: found if unset)."),
    dataset: str = typer.Option(None, "--dataset", help="fmnist (default), mnist or cifar10."),
    clusters: str = typer.Option(None, "--clusters",
                                 help="The topology, e.g. 3,6,6,6 (the default)."),
    shift: str = typer.Option(None, "--shift",
                              help="How clusters differ: rotation (default) or label_flip."),
    samples_per_client: int = typer.Option(None, "--samples-per-client",
                                           help="Records this silo draws (default 500)."),
    val_fraction: float = typer.Option(None, "--val-fraction",
                                       help="Share of them held out for validation (0.25)."),
    test_samples: int = typer.Option(None, "--test-samples",
                                     help="Test records (default 0: |test set| / 6)."),
    data_draw: str = typer.Option(
        None, "--data-draw",
        help="authors (default: the authors' code's records for the seed) or per-client."),
    data_seed: int = typer.Option(None, "--data-seed", help="Seed of the record draw (0)."),
    metrics: str = typer.Option(
        None, "--metrics",
        help="private (default: noised and charged to the budget) or exact (for a trusted "
             "server only)."),
    metrics_noise: float = typer.Option(
        None, "--metrics-noise", help="Noise multiplier of private metrics (default 10)."),
    true_cluster: int = typer.Option(
        None, "--true-cluster",
        help="The silo's true cluster, for evaluation only (default: from the topology)."),
    threads: int = typer.Option(None, "--threads", help="Torch threads (default 1)."),
    device: str = typer.Option(None, "--device", help="cpu (default) or cuda[:i]."),
    rejoin_wait: float = typer.Option(
        180.0, "--rejoin-wait", min=0.0,
        help="Seconds to keep retrying while the SuperLink refuses activation because a node "
             "with this key is online (a silo restarted after a crash ends its own stale "
             "session and rejoins in seconds; without its Flower home it waits for the old "
             "session to expire, ~60 s); 0: give up at once."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and print, start nothing."),
) -> None:
    """Launch one silo: a flower-supernode that trains with this silo's own budget, ledger and
    records, and runs only the app installed here."""
    def absolute(path: Path | None) -> str | None:  # flags are relative to the working dir
        return str(path.expanduser().resolve()) if path else None

    overrides = {"name": name, "superlink": superlink, "insecure": insecure,
                 "root-certificates": absolute(root_certificates),
                 "auth-private-key": absolute(auth_private_key), "runtime-port": runtime_port,
                 "warm": warm, "idle-poll": idle_poll}
    node = {k: v for k, v in {
        "partition-id": partition_id, "epsilon": epsilon, "delta": delta,
        "ledger-path": absolute(ledger_path), "data-dir": absolute(data_dir),
        "dataset": dataset, "clusters": clusters, "shift": shift,
        "samples-per-client": samples_per_client, "val-fraction": val_fraction,
        "test-samples": test_samples, "data-draw": data_draw, "data-seed": data_seed,
        "metrics": metrics, "metrics-noise": metrics_noise, "true-cluster": true_cluster,
        "threads": threads, "device": device}.items() if v is not None}
    try:
        silo, node_config = load_silo_file(silo_file, overrides, node)
    except ConfigError as exc:
        _stop([str(exc)])
        return
    _stop_if(check_silo(silo, node_config))
    command = supernode_command(silo, node_config)
    _print_plan(f"silo {silo.name}", {
        "SuperLink (gRPC)": silo.superlink,
        "TLS": "off (insecure)" if silo.insecure else f"on, CA {silo.root_certificates}",
        "node authentication": silo.auth_private_key or "off",
        **_silo_plan(deployed_settings(node_config)),
        "ClientApp": "warm (in the SuperNode's process, for all messages)" if silo.warm
        else "one flwr-clientapp process per message",
        "app": f"pinned: only a FAB that ships the code installed in {app_pin.PACKAGE} runs",
        "SuperLink poll when idle": f"every {silo.idle_poll:g} s",
        "command": " ".join(command)})
    if dry_run:
        return
    sys.stdout.flush()
    use_this_environment()
    raise typer.Exit(code=_supervise(command, rejoin_wait))


def _silo_plan(node: SiloConfig) -> dict[str, str]:
    """The plan's rows for a silo's own settings (resolved: as its ClientApp will use them)."""
    topology = node.topology
    cluster = (node.true_cluster if node.true_cluster >= 0
               else topology.cluster_of(node.partition_id))
    test = node.test_samples or "the dataset's default"
    return {
        "budget": f"epsilon={node.epsilon:g}, delta={node.delta:g}",
        "ledger": f"{node.ledger_path} ({_spent_so_far(node)})",
        "records": f"{node.dataset} partition {node.partition_id} of topology {{{topology}}} "
                   f"(cluster {cluster}, {node.shift}): {node.samples_per_client} samples, "
                   f"val fraction {node.val_fraction:g}, test {test}, draw {node.data_draw}, "
                   f"data seed {node.data_seed}" + (f", from {node.data_dir}"
                                                    if node.data_dir else ""),
        "metrics reported": f"private (noise multiplier {node.metrics_noise:g}, charged)"
        if node.metrics == "private" else "exact (for a trusted server only)",
        "device / threads": f"{node.device} / {node.threads}",
    }


def _spent_so_far(node: SiloConfig) -> str:
    """What the silo's ledger already holds: earlier runs' spend is not available to this one."""
    from ..privacy import PrivacyBudget, PrivacyLedger  # noqa: PLC0415

    assert node.epsilon is not None and node.delta is not None  # resolved
    try:
        ledger = PrivacyLedger.load(node.ledger_path)
    except ValueError as exc:
        return f"unreadable: {exc}"
    if not ledger.entries:
        return "new: nothing spent yet"
    spent = ledger.spent(PrivacyBudget(node.epsilon, node.delta))
    return (f"epsilon {spent:.4g} of {node.epsilon:g} already spent in earlier runs, "
            f"{max(node.epsilon - spent, 0.0):.4g} left for the next")


#: How long a silo's SuperNode or a submit's `flwr run` may take to end after Ctrl-C before it
#: is killed (an idle SuperNode ends in 1-2 s; one in the middle of a task would finish it).
STOP_GRACE_SECONDS = 5.0
#: Set by the first SIGINT/SIGTERM this process receives while it runs a child.
_signalled = threading.Event()

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


def _supervise(command: list[str], rejoin_wait: float) -> int:
    """Run the SuperNode, passing its output through. While the SuperLink refuses it because
    a node with this silo's key is online (another instance, or a crashed one's session the
    silo could not end itself), ask again every few seconds for ``rejoin_wait`` s, quietly: a
    line at the first refusal, a verdict if it lasts. An unregistered key, TLS failures and
    every other error end the silo at once, a refusal with one line saying why."""
    deadline = time.monotonic() + rejoin_wait
    _signalled.clear()
    attempts = 0
    while True:
        life = _run_supernode(command, quiet=attempts > 0)
        attempts += 1
        if life.code == 0 or life.refusal is None or life.stopped:
            return life.code
        if KEY_NOT_REGISTERED in life.refusal or time.monotonic() >= deadline:
            waited = f" (asked {attempts} times in {rejoin_wait:g} s)" if attempts > 1 else ""
            errors.print(f"error: the SuperLink refused this silo{waited}: {life.refusal}",
                         highlight=False, markup=False)
            return life.code
        if attempts == 1:
            console.print(f"the SuperLink refused this silo: {life.refusal}; asking again "
                          f"every {REJOIN_RETRY_SECONDS:g} s for up to {rejoin_wait:g} s",
                          highlight=False, markup=False, soft_wrap=True)
        if _signalled.wait(REJOIN_RETRY_SECONDS):  # Ctrl-C while waiting to retry: done
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
                               preexec_fn=_die_with_parent)
    held: list[str] | None = [] if quiet else None
    refused: list[str] = []  # the refusal line, then the SuperLink's reason if it gave one

    def pump() -> None:
        nonlocal held
        assert process.stdout is not None
        for line in process.stdout:
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

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = _forward_signals(process, group=True, grace=STOP_GRACE_SECONDS)
    code = process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    reader.join(timeout=5)
    if held and not refused:  # it ended for another reason: that must be seen
        sys.stdout.writelines(held)
    return _SuperNodeLife(code, _refusal(refused) if refused else None, stopped())


def _refusal(lines: list[str]) -> str:
    """The SuperLink's reason among a refused SuperNode's last lines (superlink_launcher's
    words), or the likely causes when it gave none."""
    for line in lines:
        for words in (KEY_NOT_REGISTERED, NODE_ONLINE):
            if words in line:
                return line[line.index(words):].strip()
    return _LIKELY_REFUSALS


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the supervisor dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@topology_app.command("compose")
def topology_compose(
    clusters: str = typer.Option("3,6,6,6", "--clusters",
                                 help="Cluster sizes of the default and gpu profiles' silos."),
    laptop_clusters: str = typer.Option("1,2,2,2", "--laptop-clusters",
                                        help="Cluster sizes of the laptop profile's silos."),
    out: Path = typer.Option(None, "--out", help="Write here instead of printing."),
) -> None:
    """Generate compose.yaml for a topology (default profile, `gpu` and `laptop` profiles)."""
    try:
        text = compose_yaml(ComposeOptions(Topology.parse(clusters),
                                           Topology.parse(laptop_clusters)))
    except ValueError as exc:
        _stop([str(exc)])
        return
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        console.print(f"wrote {out}")


@topology_app.command("silos")
def topology_silos(
    clusters: str = typer.Option(None, "--clusters",
                                 help="Default: the run config's (3,6,6,6 without one)."),
    out: Path = typer.Option(Path("clients"), "--out", help="The directory of the silo files."),
    superlink: str = typer.Option(
        "127.0.0.1:9092", "--superlink",
        help="The SuperLink's Fleet API (host:9092 by default) the silos dial, written into "
             "their files; not the control API (8000) that submit uses."),
    config: Path = typer.Option(
        None, "--config", exists=True, dir_okay=False,
        help="A run config (e.g. examples/quick.toml): each silo gets the budget and the "
             "records it would have in that run's simulation. Default: the code's defaults."),
    overrides: list[str] = typer.Option(None, "--set", help="Run-config key=value."),
    epsilon: float = typer.Option(None, "--epsilon", help="Default: the run config's."),
    runtime_port_base: int = typer.Option(9100, "--runtime-port-base",
                                          help="Silo i uses runtime port base + i."),
) -> None:
    """Write one silo file per client of a topology (clients/silo-NN.toml): each with its own
    budget, ledger path and data split."""
    from ..simulation import load_config, parse_override

    try:
        values = dict(parse_override(o) for o in overrides or [])
        if epsilon is not None:
            values["epsilon"] = epsilon
        if clusters is not None:
            values["clusters"] = clusters
        experiment = load_config(config, values)
        files = silo_files(Topology.parse(experiment.clusters), superlink, runtime_port_base,
                           experiment)
    except (ValueError, OSError) as exc:
        _stop([str(exc)])
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / f"{name}.toml").write_text(text)
    console.print(f"wrote {len(files)} silo files to {out}")


def _stop_if(problems: list[str]) -> None:
    if problems:
        _stop(problems)


def _print_plan(title: str, rows: dict[str, str]) -> None:
    table = Table(title=title, show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    console.print(table)


def _forward_signals(process: subprocess.Popen, group: bool = False,
                     grace: float | None = None) -> Callable[[], bool]:
    """Pass SIGINT/SIGTERM on to ``process`` (its whole group with ``group``); the returned
    function says whether one arrived. With ``grace``, a process still running ``grace`` s
    after the first signal, or at a second one, is killed (SIGKILL): Ctrl-C must end a
    command within seconds even when its child is busy (a silo in the middle of a task)."""
    received: list[int] = []

    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, signum)
            elif process.poll() is None:
                process.send_signal(signum)

    def kill_if_running() -> None:
        if process.poll() is None:
            send(signal.SIGKILL)

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        _signalled.set()
        if grace is None:
            send(signum)
        elif len(received) > 1:
            kill_if_running()
        else:
            send(signum)
            timer = threading.Timer(grace, kill_if_running)
            timer.daemon = True
            timer.start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    return lambda: bool(received)
