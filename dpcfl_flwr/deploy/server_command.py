"""``dpcfl certs`` and ``dpcfl server``: the deployment's CA and keys, and its SuperLink."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import typer

from ..flower_compat.environment import use_this_environment
from .certs import keep_certificates, make_certificates
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
from .supervision import console, die_with_parent, forward_signals, print_plan, stop, stop_if


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
    server_names = san or ["localhost", "127.0.0.1", "::1"]
    if keep and (out / "ca.crt").exists():
        try:
            done = keep_certificates(out, server_names, names)
        except ValueError as exc:
            stop([str(exc)])
        console.print(f"kept the existing certificates in {out}"
                      + "".join(f"; {line}" for line in done), highlight=False)
        return
    try:
        paths = make_certificates(out, server_names, names, overwrite)
    except (ValueError, FileExistsError) as exc:
        stop([str(exc)])
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
    stop_if(check_server(settings) + listen_problems(settings))
    command = superlink_command(settings)
    print_plan("SuperLink", {
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
    process = subprocess.Popen(command, process_group=0, preexec_fn=die_with_parent)
    forward_signals(process, group=True, grace=SUPERLINK_STOP_GRACE_SECONDS)
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
            stop([f"the SuperLink exited with code {process.returncode} before it listened "
                   "(see its log above)" if not alive() else
                   f"the SuperLink did not listen on {address} within 60 s"])
    if settings.register:
        done = register_keys(settings, settings.register)
        stop_if(done.failures)
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


__all__ = ["SUPERLINK_STOP_GRACE_SECONDS", "certs", "server"]
