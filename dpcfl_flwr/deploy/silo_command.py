"""``dpcfl client``: one silo, a supervised ``flower-supernode`` that trains with the silo's own
budget, ledger and records and runs only the app installed here."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from .. import app_pin
from ..config.settings import ConfigError, SiloConfig
from ..flower_compat import KEY_NOT_REGISTERED, NODE_ONLINE
from ..flower_compat.environment import use_this_environment
from ..silo.model_files import model_files, model_path
from . import silo_torch
from .silo_file import check_silo, deployed_settings, load_silo_file, supernode_command
from .supervision import (
    console,
    die_with_parent,
    errors,
    print_plan,
    signalled,
    stop,
    stop_if,
    wait_passing_output,
)


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
    run_epsilon: float = typer.Option(
        None, "--run-epsilon",
        help="How much of the budget one run plans to spend (default: all that is left)."),
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
    data_source: str = typer.Option(
        None, "--data-source",
        help="benchmark (default), arrays, image-folder, table, or an installed plug-in's "
             "(docs/own-data.md)."),
    data_path: Path = typer.Option(None, "--data-path",
                                   help="The silo's own records (file or directory)."),
    schema_file: Path = typer.Option(
        None, "--schema-file",
        help="The federation's schema (TOML), to check the records fully before joining."),
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
        "run-epsilon": run_epsilon, "ledger-path": absolute(ledger_path),
        "data-dir": absolute(data_dir),
        "dataset": dataset, "clusters": clusters, "shift": shift,
        "samples-per-client": samples_per_client, "val-fraction": val_fraction,
        "test-samples": test_samples, "data-draw": data_draw, "data-seed": data_seed,
        "metrics": metrics, "metrics-noise": metrics_noise, "true-cluster": true_cluster,
        "threads": threads, "device": device, "data-source": data_source,
        "data-path": absolute(data_path), "schema-file": absolute(schema_file)}.items()
        if v is not None}
    try:
        silo, node_config = load_silo_file(silo_file, overrides, node)
    except ConfigError as exc:
        stop([str(exc)])
        return
    checked = check_silo(silo, node_config)
    stop_if(checked.problems)
    command = supernode_command(silo, node_config)
    print_plan(f"silo {silo.name}", {
        "SuperLink (gRPC)": silo.superlink,
        "TLS": "off (insecure)" if silo.insecure else f"on, CA {silo.root_certificates}",
        "node authentication": silo.auth_private_key or "off",
        **_silo_plan(deployed_settings(node_config), checked.ledger),
        "ClientApp": "warm (in the SuperNode's process, for all messages)" if silo.warm
        else "one flwr-clientapp process per message",
        "app": f"pinned: only a FAB that ships the code installed in {app_pin.PACKAGE} runs",
        "SuperLink poll when idle": f"every {silo.idle_poll:g} s",
        "command": " ".join(command)})
    if dry_run:
        return
    sys.stdout.flush()
    use_this_environment()
    started = time.time()
    code = _supervise(command, rejoin_wait)
    _print_models(deployed_settings(node_config).ledger_path, started)
    raise typer.Exit(code=code)


def _silo_plan(node: SiloConfig, ledger: str) -> dict[str, str]:
    """The plan's rows for a silo's own settings (resolved: as its ClientApp will use them)
    and what its ledger already holds."""
    topology = node.topology
    cluster = (node.true_cluster if node.true_cluster >= 0
               else topology.cluster_of(node.partition_id))
    test = node.test_samples or "the dataset's default"
    return {
        "budget": f"epsilon={node.epsilon:g}, delta={node.delta:g}, "
                  + ("each run plans to spend what is left" if node.run_epsilon is None
                     else f"each run plans to spend at most {node.run_epsilon:g} of it"),
        "ledger": f"{node.ledger_path} ({ledger})",
        "records": f"{node.dataset} partition {node.partition_id} of topology {{{topology}}} "
                   f"(cluster {cluster}, {node.shift}): {node.samples_per_client} samples, "
                   f"val fraction {node.val_fraction:g}, test {test}, draw {node.data_draw}, "
                   f"data seed {node.data_seed}" + (f", from {node.data_dir}"
                                                    if node.data_dir else ""),
        "metrics reported": f"private (noise multiplier {node.metrics_noise:g}, charged)"
        if node.metrics == "private" else "exact (for a trusted server only)",
        "device / threads": f"{node.device} / {node.threads}",
        "models": f"{_model_pattern(node.ledger_path)}: the model it would use, at every "
                  "evaluation, marked final after the run's last round",
    }


def _model_pattern(ledger_path: str) -> str:
    return str(model_path(ledger_path, "<run id>"))


def _print_models(ledger_path: str, since: float) -> None:
    """One line per model file this silo wrote while it ran (:mod:`dpcfl_flwr.silo.kept_model`):
    where its result is, once the SuperNode has ended."""
    written = [path for path in model_files(ledger_path) if path.stat().st_mtime >= since]
    if written:
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


def _supervise(command: list[str], rejoin_wait: float) -> int:
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


__all__ = ["REJOIN_RETRY_SECONDS", "client"]
