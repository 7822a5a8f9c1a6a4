"""``dpcfl topology``: compose.yaml and the silo files of a topology."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..data import Topology
from .compose import ComposeOptions, compose_yaml, silo_files
from .supervision import console, stop

topology_app = typer.Typer(help="Deployment topologies.", no_args_is_help=True)


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
        stop([str(exc)])
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
    from ..config.config_file import load_config, parse_override

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
        stop([str(exc)])
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / f"{name}.toml").write_text(text)
    console.print(f"wrote {len(files)} silo files to {out}")


__all__ = ["topology_app", "topology_compose", "topology_silos"]
