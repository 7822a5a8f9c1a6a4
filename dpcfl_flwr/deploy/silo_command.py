"""``dpcfl client``: one silo, a supervised ``flower-supernode`` that trains with the silo's own
budget, ledger and records and runs only the app installed here."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .. import app_pin
from ..config.settings import ConfigError, SiloConfig
from ..flower_compat.environment import use_this_environment
from ..silo.model_files import model_path
from .silo_file import check_silo, deployed_settings, load_silo_file, supernode_command
from .silo_supervisor import supervise_lean
from .supervision import print_plan, stop, stop_if


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
    schema_file: str = typer.Option(
        None, "--schema-file",
        help="The federation's schema (TOML) the silo pins: its records are checked against "
             "it before joining, and a run with another schema is refused. Required for own "
             "records; an empty value leaves it unset (compose passes one per silo)."),
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
        "data-path": absolute(data_path),
        "schema-file": absolute(Path(schema_file)) if schema_file else None}.items()
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
    # The checks above needed the settings, numpy and the console (~75 MB resident); the
    # supervisor lives as long as its silo, so it sheds them by becoming a lean process
    # (same pid, signals and output) that only runs the SuperNode (silo_supervisor.py).
    supervise_lean(command, rejoin_wait, deployed_settings(node_config).ledger_path)


def _silo_plan(node: SiloConfig, ledger: str) -> dict[str, str]:
    """The plan's rows for a silo's own settings (resolved: as its ClientApp will use them)
    and what its ledger already holds."""
    return {
        "budget": f"epsilon={node.epsilon:g}, delta={node.delta:g}, "
                  + ("each run plans to spend what is left" if node.run_epsilon is None
                     else f"each run plans to spend at most {node.run_epsilon:g} of it"),
        "ledger": f"{node.ledger_path} ({ledger})",
        "records": _records_row(node),
        "metrics reported": f"private (noise multiplier {node.metrics_noise:g}, charged)"
        if node.metrics == "private" else "exact (for a trusted server only)",
        "device / threads": f"{node.device} / {node.threads}",
        "models": f"{_model_pattern(node.ledger_path)}: the model it would use, at every "
                  "evaluation, marked final after the run's last round",
    }


def _records_row(node: SiloConfig) -> str:
    """The plan's records row: the benchmark slice, or the silo's own records, their source,
    schema and split, as the silo reads them (no count: the check reads them)."""
    if node.data_source == "benchmark":
        topology = node.topology
        cluster = (node.true_cluster if node.true_cluster >= 0
                   else topology.cluster_of(node.partition_id))
        test = node.test_samples or "the dataset's default"
        return (f"{node.dataset} partition {node.partition_id} of topology {{{topology}}} "
                f"(cluster {cluster}, {node.shift}): {node.samples_per_client} samples, "
                f"val fraction {node.val_fraction:g}, test {test}, draw {node.data_draw}, "
                f"data seed {node.data_seed}" + (f", from {node.data_dir}"
                                                 if node.data_dir else ""))
    split = (f"split by column {node.split_column!r}" if node.split_column else
             f"split drawn with data seed {node.data_seed} (test fraction "
             f"{node.test_fraction:g}, val fraction {node.val_fraction:g})")
    group = f", true cluster {node.true_cluster}" if node.true_cluster >= 0 else ""
    return (f"own records ({node.data_source}) at {node.data_path}, pinned schema "
            f"{node.schema_file or 'none'}; {split}{group}")


def _model_pattern(ledger_path: str) -> str:
    return str(model_path(ledger_path, "<run id>"))


__all__ = ["client"]
