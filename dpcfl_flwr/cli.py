"""The ``dpcfl`` command line.

Commands whose modules import torch at the top (``attack``, ``audit``) are registered lazily
(:class:`LazyCommandsGroup`), and the others import their training code inside their bodies:
``dpcfl client``, the supervisor that lives as long as its silo and never trains, so runs
without torch (some 300 MB resident saved per silo), and ``dpcfl --help`` still lists every
command.
"""

from __future__ import annotations

import json
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from .data import DataError
from .privacy.defaults import DEFAULT_ACCOUNTANT, DEFAULT_BUDGET_MODE, DEFAULT_CONVERSION
from .privacy.schedule import FULL_BATCH, two_stage_schedule

if TYPE_CHECKING:
    from .config.settings import ExperimentConfig


def _add_attack(typer_app: typer.Typer) -> None:
    from .attacks.command import attack_app

    typer_app.add_typer(attack_app, name="attack")  # dpcfl attack dlg (docs/attacks.md)


def _add_audit(typer_app: typer.Typer) -> None:
    from .audit.command import audit

    typer_app.command("audit")(audit)  # the one-run privacy audit (docs/privacy.md)


#: Commands registered when first named (or listed by ``dpcfl --help``), by what adds each to
#: a Typer app: their modules import torch.
LAZY_COMMANDS = {"attack": _add_attack, "audit": _add_audit}


class LazyCommandsGroup(TyperGroup):
    """The ``dpcfl`` group: its :data:`LAZY_COMMANDS` are built when named, or when the
    commands are listed (``dpcfl --help``), each as it would have been registered on
    :data:`app` (same help settings, listed where Typer lists it)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        for name in LAZY_COMMANDS:
            self.get_command(ctx, name)
        # Typer lists commands before groups, each in the order registered
        return sorted(super().list_commands(ctx),
                      key=lambda name: isinstance(self.commands[name], click.Group))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            holder = typer.Typer(rich_markup_mode=self.rich_markup_mode)
            LAZY_COMMANDS[cmd_name](holder)
            _plain_help(holder)
            self.add_command(typer.main.get_group(holder).commands[cmd_name], cmd_name)
        return super().get_command(ctx, cmd_name)


# Plain help (click's layout): Typer's rich panels cut option names (`--root-certifica…`) to
# fit an 80-column terminal and read `[method.<name>]` in a help text as markup.
app = typer.Typer(help="Differentially private clustered federated learning on Flower.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  cls=LazyCommandsGroup)
privacy_app = typer.Typer(help="Privacy accounting tools.", no_args_is_help=True)
app.add_typer(privacy_app, name="privacy")

console = Console()
# Errors go to stderr on one line, never wrapped: they are read by people and by log scrapers.
error_console = Console(stderr=True, soft_wrap=True)


class ConversionChoice(StrEnum):
    CLASSIC = "classic"
    TIGHT = "tight"


class BudgetModeChoice(StrEnum):
    SPLIT = "split"
    JOINT = "joint"


class AccountantChoice(StrEnum):
    RDP = "rdp"
    PLD = "pld"


class PlainHelpCommand(TyperCommand):
    """A command whose plain help shows ``[default: x]`` as written: Typer 0.20 escapes it for
    rich markup (``\\[default: x]``) even when the help is not rendered by rich."""

    def get_help(self, ctx: click.Context) -> str:
        return super().get_help(ctx).replace("\\[", "[")


def _plain_help(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` and of its sub-apps :class:`PlainHelpCommand`."""
    for command in typer_app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = PlainHelpCommand
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _plain_help(group.typer_instance)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dpcfl-flwr {_package_version('dpcfl-flwr')} "
                   f"(flwr {_package_version('flwr')}, opacus {_package_version('opacus')}, "
                   f"torch {_package_version('torch')})")
        raise typer.Exit()


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the versions of dpcfl-flwr and its engines."),
) -> None:
    """Differentially private clustered federated learning on Flower."""


def _parse_first_batch(value: str) -> int | Literal["full"]:
    if value == FULL_BATCH:
        return "full"
    try:
        batch = int(value)
    except ValueError:
        raise typer.BadParameter(f"expected 'full' or a positive integer, got {value!r}") from None
    if batch < 1:
        raise typer.BadParameter(f"expected a positive batch size, got {batch}")
    return batch


def _fail(message: str, code: int = 2) -> None:
    error_console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    raise typer.Exit(code=code)


@privacy_app.command("noise")
def privacy_noise(
    samples: int = typer.Option(..., "--samples", min=2, help="Training samples N_i."),
    batch: int = typer.Option(..., "--batch", min=1, help="Batch size b in rounds 2..E."),
    first_batch: str = typer.Option(
        FULL_BATCH, "--first-batch", help="Round-1 batch: 'full' (R-DPCFL) or an int (= --batch "
        "gives the baselines' single-stage schedule)."),
    epsilon: float = typer.Option(..., "--epsilon", min=0.0, help="Total budget eps."),
    delta: float = typer.Option(1e-4, "--delta", min=0.0, max=1.0, help="Target delta."),
    rounds: int = typer.Option(..., "--rounds", min=1, help="Communication rounds E."),
    epochs: int = typer.Option(1, "--epochs", min=1, help="Local epochs K per round."),
    conversion: ConversionChoice = typer.Option(
        ConversionChoice(DEFAULT_CONVERSION), "--conversion",
        help="RDP to (eps, delta): tight (Balle et al. 2020) or classic (the authors')."),
    select_rounds: int = typer.Option(0, "--select-rounds", min=0,
                                      help="Private cluster selections T_sel to reserve for."),
    select_ratio: float = typer.Option(0.03, "--select-ratio", min=0.0, max=1.0,
                                       help="eps_select = ratio * eps."),
    budget_mode: BudgetModeChoice = typer.Option(
        BudgetModeChoice(DEFAULT_BUDGET_MODE), "--budget-mode",
        help="joint: everything composed, converted once; split: the authors' eps_train = "
        "eps - eps_clustering (their noise levels with --conversion classic --accountant rdp)."),
    paper_steps: bool = typer.Option(
        False, "--paper-steps", help="Count N/b steps per epoch (the authors' planning formula) "
        "instead of the ceil(N/b) a client executes."),
    accountant: AccountantChoice = typer.Option(
        AccountantChoice(DEFAULT_ACCOUNTANT), "--accountant", help="pld: RDP's and PLD's plans "
        "side by side, a silo using PLD's (docs/privacy.md#pld-accounting); rdp: RDP's alone."),
    at_z: float = typer.Option(None, "--at-z", min=0.0, help="With --accountant pld: the z to "
                               "show both epsilons at (default: RDP's z)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Calibrate the noise multiplier z for a client's whole DP-SGD schedule."""
    # Imported here: the accountants bring dp-accounting and SciPy's signal package (~1 s and
    # ~50 MB), which every other command, a silo's supervisor among them, does without.
    from .privacy.budget import plan_noise
    from .results.privacy_report import (
        authors_noise_multiplier,
        compare_accountants,
        plan_dict,
        print_comparison,
        print_noise_table,
    )

    first = _parse_first_batch(first_batch)
    shape = {"samples": samples, "batch": batch, "first_batch": first, "rounds": rounds,
             "epochs": epochs}
    try:
        schedule = two_stage_schedule(samples, batch, epochs, rounds, first, exact=not paper_steps)
        if accountant == AccountantChoice.PLD:
            both = compare_accountants(schedule, epsilon, delta, select_rounds, select_ratio,
                                       conversion.value, budget_mode.value, at_z)
        else:
            plan = plan_noise(schedule, epsilon, delta, select_rounds, select_ratio,
                              conversion.value, budget_mode.value, accountant="rdp")
    except ValueError as exc:
        _fail(str(exc))
        return
    authors = authors_noise_multiplier(schedule, epsilon, delta, select_rounds, select_ratio)
    if accountant == AccountantChoice.PLD:
        result = {**both, **shape, "authors_noise_multiplier": authors}
    else:
        result = {**plan_dict(plan), **shape, "authors_noise_multiplier": authors}
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    elif accountant == AccountantChoice.PLD:
        print_comparison(console, result, select_rounds > 0)
    else:
        print_noise_table(console, result, select_rounds > 0)


@app.command("probe")
def probe(
    dataset: str = typer.Option("fmnist", help="fmnist | mnist | cifar10."),
    data_dir: str = typer.Option(None, help="Dataset directory (Fashion-MNIST: auto-detected)."),
    clusters: str = typer.Option("3,6,6,6", help="Clients per true cluster; cluster 0 first."),
    shift: str = typer.Option("rotation", help="rotation | label_flip."),
    model: str = typer.Option("cnn", help="cnn | resnet18."),
    samples: int = typer.Option(2000, min=2, help="Training samples per client N_i."),
    epsilon: float = typer.Option(10.0, min=0.0, help="Per-client budget eps."),
    delta: float = typer.Option(1e-4, help="Per-client delta."),
    rounds: int = typer.Option(200, min=1, help="E, for the noise calibration."),
    batch: int = typer.Option(32, min=1, help="b in rounds 2..E."),
    first_batch: str = typer.Option(FULL_BATCH, help="Round-1 batch: full or an int."),
    lr: float = typer.Option(0.005, help="DP-SGD learning rate."),
    clip: float = typer.Option(3.0, help="Per-sample clipping norm C."),
    n_clusters: int = typer.Option(4, help="M; 0 = choose by maximum MSS over 2..10."),
    seed: int = typer.Option(0, help="Seed of the records, theta_init and the GMM."),
    threads: int = typer.Option(1, min=1, help="Torch threads."),
    pca_components: int = typer.Option(0, min=0, help="0: M - 1 axes (>= 2); 2: the authors'."),
    draw: str = typer.Option("authors", help="authors | per-client: which records a client gets."),
    out: Path = typer.Option(Path("results/probe"), help="Directory for probe.json + plot."),
) -> None:
    """Round 1 only: do the clients' DP updates reveal their clusters? (Fig. 5, RQ5)"""
    from .dpsgd.training import configure_threads
    from .runs.probe import ProbeSettings, run_probe

    configure_threads(threads)
    settings = ProbeSettings(dataset, data_dir, clusters, shift, model, samples, epsilon, delta,
                             rounds, batch, _parse_first_batch(first_batch), max(rounds // 10, 1),
                             lr, clip, n_clusters or None, seed, pca_components, draw)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("round-1 DP-SGD per client", total=sum(
            int(c) for c in clusters.split(",")))
        try:
            result = run_probe(settings, out, progress=lambda _: bar.advance(task))
        except (ValueError, DataError) as exc:
            _fail(str(exc))
            return
    table = Table(title=f"round-1 clustering probe ({out})", show_header=False)
    for key in ("noise_multiplier", "n_clusters", "mss", "mpo", "switch_round", "em_iterations",
                "ari"):
        value = result[key]
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


RAY_ADDRESS_HELP = ("Run on the Ray cluster whose head is at host:port (ray start --head) "
                    "instead of a local Ray (docs/simulation.md#a-ray-cluster).")


def _one_ray(cpus: int, ray_address: str | None) -> None:
    """Refuse --cpus beside --ray-address, and an address where no cluster answers (before
    the run config and its model are loaded)."""
    from .runs.ray_cluster import probe

    if ray_address is None:
        return
    if cpus:
        raise ValueError("--cpus sizes a local Ray; with --ray-address the cluster's own "
                         "resources decide (silo-cpus sets each silo's share)")
    probe(ray_address)


def _records_title(experiment: ExperimentConfig) -> str:
    """What a simulation trains on, as its title says it: the benchmark and its shift, or
    the silos' own records and their source."""
    if experiment.data_source == "benchmark":
        return f"{experiment.dataset} ({experiment.shift}, clusters {experiment.clusters})"
    return (f"the silos' own records ({experiment.data_source}, "
            f"{experiment.topology.num_clients} silos)")


@app.command("simulate")
def simulate(
    config: Path = typer.Option(None, "--config", exists=True, dir_okay=False,
                                help="TOML file of run-config keys (see examples/)."),
    overrides: list[str] = typer.Option(None, "--set", help="Override a key: --set epsilon=5."),
    out: Path = typer.Option(None, "--out", help="Results directory (default: results/<time>)."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Reuse an existing results directory (its ledgers too)."),
    cpus: int = typer.Option(0, "--cpus", min=0, help="CPUs for Ray (0: all)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show Flower's and Ray's logs."),
    quiet: bool = typer.Option(False, "--quiet", help="No live view; one line per round."),
    resume: Path = typer.Option(None, "--resume", file_okay=False,
                                help="Continue the killed run of this results directory."),
    ray_address: str = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
) -> None:
    """Run the ServerApp and ClientApp in Flower's simulation engine, with live progress."""
    from .config.config_file import parse_override
    from .runs.progress import ProgressFollower, summary_table
    from .runs.ray_cluster import ClusterError
    from .runs.simulation import AlreadyFinished, experiment_to_run, run_simulation
    from .strategies import TooFewSilos
    from .strategies.exchange import RunInterrupted

    try:
        _one_ray(cpus, ray_address)
        pairs = dict(parse_override(item) for item in overrides or [])
        experiment = experiment_to_run(config, pairs, out, overwrite, resume)
    except AlreadyFinished as done:
        console.print(str(done), highlight=False)
        return
    except (ValueError, OSError) as exc:
        _fail(str(exc))
        return
    out_dir = Path(experiment.out_dir)
    _configure_logging(verbose, round_lines=quiet)
    console.print(f"[bold]dpcfl simulate[/]: {experiment.method} on {_records_title(experiment)}"
                  f", E={experiment.num_server_rounds}, eps={experiment.epsilon:g} -> {out_dir}",
                  highlight=False)
    follower = None if quiet else ProgressFollower(out_dir, experiment.num_server_rounds,
                                                   console)
    if follower is not None:
        follower.start()
    try:
        run_simulation(experiment, cpus=cpus or None, verbose=verbose, ray_address=ray_address)
    except ClusterError as exc:
        _fail(str(exc))
        return
    except TooFewSilos as exc:
        _fail(str(exc), code=1)
        return
    except RunInterrupted as exc:
        _fail(f"{exc}; results so far in {out_dir}", code=exc.status)
        return
    finally:
        if follower is not None:
            follower.stop()
    results_file = out_dir / "results.json"
    if not results_file.exists():
        _fail(f"the run ended without results; see the log above ({out_dir})")
        return
    results = json.loads(results_file.read_text())
    if not results.get("complete"):
        _fail(f"the run stopped early; partial results in {results_file}")
        return
    console.print(summary_table(results))


@app.command("compare")
def compare(
    methods: str = typer.Option("rdpcfl,global,local,ifca,mrmtl,oracle", "--methods",
                                help="Comma-separated methods."),
    epsilons: str = typer.Option("3,5,10", "--epsilons", help="Comma-separated budgets."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated seeds."),
    config: Path = typer.Option(None, "--config", exists=True, dir_okay=False,
                                help="Run-config TOML, with optional [method.<name>] tables."),
    out: Path = typer.Option(Path("results/compare"), "--out", help="Grid directory."),
    cpus: int = typer.Option(0, "--cpus", min=0, help="CPUs for each simulation (0: all)."),
    overrides: list[str] = typer.Option(
        None, "--set", help="Override a key in every run: --set budget-mode=joint."),
    aggregations: str = typer.Option(
        None, "--aggregations", help="Comma-separated aggregation rules: one row per method "
        "and rule (method/rule), runs in <out>/<method>-<rule>/. Default: the config's rule."),
    parallel: int = typer.Option(1, "--parallel", min=1, help="Runs at once, each with "
                                 "--cpus / K of a local Ray (or sharing the --ray-address "
                                 "cluster)."),
    ray_address: str = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    baselines: bool = typer.Option(
        True, "--baselines/--no-baselines", help="Run local and majority (the majority-class "
        "predictor) beside --methods, as rows of every table."),
) -> None:
    """Run methods x epsilons x seeds (each a full simulation), resuming finished runs, and
    write summary.md / summary.csv / comparison.png in the paper's form, with accuracy,
    balanced accuracy and (two classes) AUROC, local and majority beside the methods."""
    from .config.config_file import parse_override
    from .runs.compare import (
        apply_overrides,
        baselines_for,
        load_grid_config,
        parse_numbers,
        plan_grid,
        run_grid,
        variants,
    )
    from .runs.compare_report import collect as collect_cells
    from .runs.compare_report import write_reports

    try:
        _one_ray(cpus, ray_address)  # one line now, not one failed run per cell
        method_list = [m.strip() for m in methods.split(",") if m.strip()]
        eps_list = parse_numbers(epsilons, float)
        seed_list = parse_numbers(seeds, int)
        rules = None if aggregations is None else [
            r.strip() for r in aggregations.split(",") if r.strip()]
        base, per_method = apply_overrides(
            *load_grid_config(config), dict(parse_override(item) for item in overrides or []),
            axis=rules is not None)
        added = baselines_for(method_list) if baselines else []
        runs = plan_grid(method_list, eps_list, seed_list, out, rules, added)
        # soft_wrap: one event, one line, however long (the lines of cells run at once mix)
        failed = run_grid(runs, base, per_method, cpus, report=lambda line: console.print(
            line, highlight=False, soft_wrap=True), parallel=parallel, ray_address=ray_address)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
        return
    table = write_reports(collect_cells(runs), variants(method_list, rules, added), eps_list,
                          out)
    console.print(table)
    console.print(f"tables and plot in {out}/summary.md, summary.csv, comparison.png")
    if failed:
        _fail(f"{len(failed)} run(s) failed: {', '.join(r.label for r in failed)}")


@app.command("report")
def report(
    results_dir: Path = typer.Argument(..., exists=True, file_okay=False,
                                       help="A run's results directory."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Redraw the figures."),
) -> None:
    """Print a run's summary table (and per-silo outcome), redraw its figures and say where
    its TensorBoard event files are."""
    from .results.board import BOARD_DIR, event_files
    from .results.recorder import redraw_figures
    from .runs.progress import silo_table, summary_table

    path = results_dir / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"{path}: cannot read the results ({exc})")
        return
    console.print(summary_table(results))
    console.print(silo_table(results))
    if not results.get("complete"):
        console.print("[yellow]the run did not finish: these are its last saved results[/]")
    if plots:
        for figure in redraw_figures(results, results_dir):
            console.print(f"figure: {figure}")
    if event_files(results_dir):  # runs before the event files, or tensorboard = false: none
        console.print(f"per-round metrics in TensorBoard: tensorboard --logdir "
                      f"{results_dir / BOARD_DIR}", highlight=False)


def _configure_logging(verbose: bool, round_lines: bool = False) -> None:
    """Rich log lines; unless ``verbose``, framework chatter only from warnings up, and the
    strategy's round lines only with ``round_lines`` (--quiet: no live view shows them)."""
    import logging

    from rich.logging import RichHandler

    handler = RichHandler(console=console, show_path=False, markup=False)
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        # The live view already shows every round; keep framework chatter to warnings.
        quiet = ("flwr", "ray", "alembic") + (() if round_lines else
                                               ("dpcfl_flwr.strategies.strategy",))
        handler.addFilter(lambda record: record.levelno >= logging.WARNING
                          or not record.name.startswith(quiet))
        logging.getLogger("flwr").setLevel(logging.WARNING)  # its own handler's round lines
    logging.basicConfig(level=logging.INFO, handlers=[handler], format="%(message)s",
                        force=True)


def _register_deployment_commands() -> None:
    from .deploy import commands

    app.command("certs")(commands.certs)
    app.command("server")(commands.server)
    app.command("client")(commands.client)
    app.command("submit")(commands.submit)
    app.add_typer(commands.topology_app, name="topology")
    app.add_typer(commands.data_app, name="data")


_register_deployment_commands()
_plain_help(app)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
