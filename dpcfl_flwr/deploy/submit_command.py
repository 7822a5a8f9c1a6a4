"""``dpcfl submit``: a run with a validated run config, followed to its end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from ..config.config_file import flat_keys, toml_value
from ..flower_compat.environment import flower_tool, use_this_environment
from .runs import StreamWatch, final_status, follow_hint
from .superlink import ServerSettings, wait_until_listening, write_connection
from .supervision import (
    console,
    die_with_parent,
    errors,
    stop,
    wait_passing_output,
)

if TYPE_CHECKING:
    from ..config.settings import ExperimentConfig


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
    resume: Path = typer.Option(
        None, "--resume", file_okay=False,
        help="Continue the killed run whose results directory (its out-dir, on this host) "
             "this is, from its last completed round."),
    resume_on_restart: int = typer.Option(
        0, "--resume-on-restart", min=0,
        help="When the SuperLink goes away during the run (the log stream ends, the run not "
             "finished), wait for it and submit the run again with --resume, up to this many "
             "times (its out-dir must be readable here)."),
) -> None:
    """Submit a run to a SuperLink (`flwr run` with a validated run config)."""
    from ..config.config_file import load_config, parse_override
    from ..runs.simulation import AlreadyFinished, resumed_experiment

    if not insecure and root_certificates is None:
        stop(["TLS needs --root-certificates (or --insecure for local experiments)"])
    try:
        pairs = dict(parse_override(o) for o in overrides or [])
        experiment = (resumed_experiment(resume.resolve(), config, pairs) if resume
                      else load_config(config, pairs))
    except AlreadyFinished as done:
        console.print(escape(str(done)), highlight=False)
        return
    except (ValueError, OSError) as exc:
        stop([str(exc)])
        return
    short = experiment.too_few_silos()
    if short:
        stop([short])
    undeclared = _undeclared_keys(app_dir, experiment.to_run_config())
    if undeclared:  # Flower would refuse the run with "Invalid run configuration" only
        stop([f"the app in {app_dir} does not declare the run-config key(s) "
               f"{', '.join(undeclared)} in \\[tool.flwr.app.config] of its pyproject.toml "
               "(is it another version of dpcfl-flwr?)"])
    settings = ServerSettings(insecure=insecure, api_address=superlink,
                              connection=SUBMIT_CONNECTION)
    settings.certs = None if root_certificates is None else root_certificates.parent
    home = write_connection(settings, root_certificates).parent
    os.environ.setdefault("FLWR_HOME", str(home))
    use_this_environment()
    for attempt in range(resume_on_restart + 1):
        if attempt:
            experiment = _after_restart(settings, experiment, attempt, resume_on_restart)
        last = attempt == resume_on_restart
        watch = _submit_and_follow(app_dir, home, experiment, superlink, stream, last)
        if watch is not None:
            _end_with_outcome(watch, last)  # returns only for a run to resume


def _submit_and_follow(app_dir: Path, home: Path, experiment: ExperimentConfig,
                       superlink: str, stream: bool, last: bool = True
                       ) -> StreamWatch | None:
    """``flwr run`` of ``experiment``, followed (``stream``) until its log stream ends, and
    what it saw. On the ``last`` try, exits as ``flwr run`` did when the run never started or
    failed; before it, a run that never started returns None (a SuperLink still going away,
    say: the caller tries again). Exits on Ctrl-C."""
    run_config = home / "dpcfl-run-config.toml"
    run_config.write_text("".join(f"{k} = {toml_value(v)}\n"
                                  for k, v in experiment.to_run_config().items()))
    command = [flower_tool("flwr") or "flwr", "run", str(app_dir), SUBMIT_CONNECTION,
               "--run-config", str(run_config)]
    if stream:
        command.append("--stream")
    console.print(f"submitting {experiment.method} (E={experiment.num_server_rounds}, "
                  f"{experiment.expected_clients} silos) to {superlink}")
    code, watch, stopped = _follow(command)
    hint = follow_hint(watch.run_id, SUBMIT_CONNECTION, Path(os.environ["FLWR_HOME"]))
    run = "the run" if watch.run_id is None else f"run {watch.run_id}"
    if stopped:
        errors.print(f"stopped following {run}; it goes on on the SuperLink ({hint})"
                     if watch.run_id is not None else "stopped before the SuperLink said it "
                     f"started the run; it may have ({hint})", highlight=False, markup=False)
        raise typer.Exit(code=128 + signal.SIGINT)
    if watch.run_id is None and not last:
        return None
    if watch.run_id is None or (code != 0 and last):
        raise typer.Exit(code=code or 1)  # `flwr run` has said why
    if not stream:
        console.print(f"{run} started ({hint})", highlight=False, markup=False)
        raise typer.Exit(code=0)
    return watch


#: Seconds ``--resume-on-restart`` waits for a SuperLink that went away to listen again,
#: after a pause of ``RESTART_SETTLE`` seconds.
RESTART_WAIT = 900.0
RESTART_SETTLE = 5.0


def _after_restart(settings: ServerSettings, experiment: ExperimentConfig, attempt: int,
                   attempts: int) -> ExperimentConfig:
    """Wait for the SuperLink to listen again, then the run config that continues
    ``experiment`` from its checkpoint in its out-dir; one line and exit 1 when either
    fails."""
    from ..runs.simulation import AlreadyFinished, resumed_experiment
    from ..strategies.checkpoint import CHECKPOINT

    errors.print(f"the SuperLink went away during the run: waiting up to {RESTART_WAIT:.0f} s "
                 f"for it, then resuming from {experiment.out_dir} (attempt {attempt} of "
                 f"{attempts})", highlight=False, markup=False)
    time.sleep(RESTART_SETTLE)  # a SuperLink on its way down may still accept connections
    if not wait_until_listening(settings.api_address, RESTART_WAIT):
        stop([f"the SuperLink at {settings.api_address} did not come back within "
              f"{RESTART_WAIT:.0f} s"])
    out = Path(experiment.out_dir).resolve()
    if not (out / CHECKPOINT).exists():
        return experiment  # it went away before the first checkpoint: the run from the start
    try:
        return resumed_experiment(out, None, {})
    except AlreadyFinished as done:
        console.print(escape(str(done)), highlight=False)
        raise typer.Exit(code=0) from None
    except (ValueError, OSError) as exc:
        stop([f"cannot resume: {exc}"])
        raise


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
                               preexec_fn=die_with_parent)
    watch = StreamWatch()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            watch.see(line)

    code, stopped = wait_passing_output(process, pump)
    return code, watch, stopped


def _end_with_outcome(watch: StreamWatch, last: bool = True) -> None:
    """Exit 0 if the followed run completed; 1, its one error line last, if it failed. For a
    run the SuperLink does not report finished (gone, or restarted without it), return (the
    caller resumes it) unless this was the ``last`` try, which exits 1 too."""
    assert watch.run_id is not None
    status = final_status(flower_tool("flwr") or "flwr", SUBMIT_CONNECTION, watch.run_id,
                          os.environ)
    hint = follow_hint(watch.run_id, SUBMIT_CONNECTION, Path(os.environ["FLWR_HOME"]))
    if status is None or not status.finished:
        if not last:
            return
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
    raise typer.Exit(code=0)


def _undeclared_keys(app_dir: Path, run_config: dict[str, object]) -> list[str]:
    """The keys of ``run_config`` that the app's ``[tool.flwr.app.config]`` lacks (its method
    tables flattened as Flower flattens them: ``[...config.rdpcfl]`` declares ``rdpcfl.*``)."""
    try:
        with (app_dir / "pyproject.toml").open("rb") as handle:
            declared = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []  # not an app Flower can run either: `flwr run` says why
    return sorted(set(run_config) - set(flat_keys(declared)))


__all__ = ["SUBMIT_CONNECTION", "submit"]
