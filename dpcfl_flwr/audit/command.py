"""``dpcfl audit``: the one-run privacy audit of a silo's DP-SGD
(docs/privacy.md#auditing-the-guarantee).

It trains a model on a silo's records (a dataset's, or a synthetic silo's) with our DP-SGD plus
gradient canaries, tests membership of the canaries, and writes ``audit.json`` and ``audit.md``
to ``--out``: the accountant's epsilon for the steps run against the audit's lower bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, cast

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..data import DataError
from ..models import MODEL_NAMES, count_parameters
from ..privacy.history import ACCOUNTANTS, AccountantName
from .run import AuditResult, AuditSettings, noise_for_epsilon, run_audit
from .setting import SYNTHETIC, image_silo, synthetic_silo

console = Console()
errors = Console(stderr=True, soft_wrap=True)


def _stop(problem: str) -> None:
    errors.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)
    raise typer.Exit(code=2)


def markdown(result: AuditResult) -> str:
    """The audit as a markdown table, one row."""
    s = result.settings
    verdict = "passed" if result.passed else "**FAILED: the bound exceeds the claim**"
    return (
        "| z | noise | steps | q | canaries | guesses | correct | confidence | delta | "
        "claimed eps | audited lower bound | verdict |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {s.noise_multiplier:.4g} | {'off' if s.noiseless else 'on'} | {result.steps} | "
        f"{result.sample_rate:.4g} | {s.canaries} | {result.guesses} | {result.correct} | "
        f"{s.confidence:g} | {s.delta:g} | {result.claimed_epsilon:.3f} "
        f"({s.accountant}) | {result.lower_bound:.3f} | {verdict} |\n")


def audit(
    out: Annotated[Path, typer.Option(
        "--out", file_okay=False, help="Directory for audit.json and audit.md.")],
    noise: Annotated[float | None, typer.Option(
        help="The noise multiplier z (or give --epsilon).")] = None,
    epsilon: Annotated[float | None, typer.Option(
        help="Calibrate z so that the audited steps spend this epsilon.")] = None,
    dataset: Annotated[str, typer.Option(
        help=f"fmnist, mnist, cifar10 or {SYNTHETIC} (Gaussian classes, an MLP).")] = "fmnist",
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", file_okay=False, help="The dataset's directory (fmnist is found "
        "by itself).")] = None,
    records: Annotated[int, typer.Option(help="The silo's training records N.")] = 375,
    model_name: Annotated[str, typer.Option(
        "--model", help=f"{', '.join(MODEL_NAMES)} (image datasets).")] = "cnn",
    batch: Annotated[int, typer.Option(help="Expected Poisson batch b (rate b / N).")] = 32,
    clip: Annotated[float, typer.Option(help="DP-SGD's clipping norm C.")] = 3.0,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate.")] = 0.005,
    rounds: Annotated[int, typer.Option(help="Rounds of local training audited.")] = 30,
    epochs: Annotated[int, typer.Option(help="Local epochs per round.")] = 1,
    canaries: Annotated[int, typer.Option(help="Gradient canaries m.")] = 1000,
    guesses: Annotated[int | None, typer.Option(
        help="k+ = k-: 'in' and 'out' guesses each (default m / 10).")] = None,
    confidence: Annotated[float, typer.Option(help="Confidence of the lower bound.")] = 0.95,
    delta: Annotated[float, typer.Option(help="delta of claim and bound.")] = 1e-5,
    accountant: Annotated[str, typer.Option(help="pld or rdp: who makes the claim.")] = "pld",
    noiseless: Annotated[bool, typer.Option(
        "--noiseless", help="Demonstration: train without noise, a broken privatiser, "
        "while claiming z's epsilon.")] = False,
    seed: Annotated[int | None, typer.Option(
        help="Fixes data draw, model, canaries, sampling and noise (default: OS entropy "
             "for all but the data draw and model, which use 0).")] = None,
) -> None:
    """Audit DP-SGD empirically: a lower bound on epsilon from gradient canaries (one run)."""
    if (noise is None) == (epsilon is None):
        _stop("give exactly one of --noise Z and --epsilon EPS")
    if accountant not in ACCOUNTANTS:
        _stop(f"--accountant {accountant!r}: expected one of {', '.join(ACCOUNTANTS)}")
    torch.set_num_threads(1)  # the shared-VM rule of training.configure_threads
    try:
        if dataset.strip().lower() == SYNTHETIC:
            model, x, y = synthetic_silo(records, 0 if seed is None else seed)
        else:
            model, x, y = image_silo(dataset.strip().lower(), records, model_name,
                                     0 if seed is None else seed,
                                     None if data_dir is None else str(data_dir))
        settings = _settings(noise, epsilon, records, batch, clip, lr, rounds, epochs,
                             canaries, guesses, confidence, delta, accountant, noiseless)
        if canaries > count_parameters(model):
            raise ValueError(f"--canaries {canaries}: the model has only "
                             f"{count_parameters(model)} coordinates to put them on")
    except (DataError, ValueError, OSError) as exc:
        _stop(str(exc))
        return
    console.print(f"auditing {dataset}, N = {records}, z = {settings.noise_multiplier:.4g}"
                  f"{' (noise OFF)' if noiseless else ''}, {rounds} round(s), "
                  f"{canaries} canaries", highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(),
               TextColumn("round {task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("DP-SGD with canaries", total=rounds)
        try:
            result = run_audit(model, x, y, settings, seed=seed,
                               progress=lambda done, _: bar.update(task, completed=done))
        except ValueError as exc:
            _stop(str(exc))
            return
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    table = markdown(result)
    (out / "audit.md").write_text(table)
    console.print(table, highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {out / 'audit.json'} and {out / 'audit.md'}", highlight=False)


def _settings(noise: float | None, epsilon: float | None, records: int, batch: int,
              clip: float, lr: float, rounds: int, epochs: int, canaries: int,
              guesses: int | None, confidence: float, delta: float, accountant: str,
              noiseless: bool) -> AuditSettings:
    """The audit's settings; z calibrated from ``epsilon`` when no ``noise`` is given."""
    if not 1 <= batch <= records:
        raise ValueError(f"--batch {batch}: expected 1 to --records ({records})")
    def build(z: float) -> AuditSettings:
        return AuditSettings(noise_multiplier=z, batch_size=batch, clip_norm=clip,
                             learning_rate=lr, rounds=rounds, epochs=epochs,
                             canaries=canaries, guesses=guesses, confidence=confidence,
                             delta=delta, accountant=cast(AccountantName, accountant),
                             noiseless=noiseless)
    if noise is not None:
        if not noise > 0:
            raise ValueError(f"--noise {noise}: z must be > 0 (use --noiseless to audit "
                             "training without noise)")
        return build(noise)
    assert epsilon is not None
    return build(noise_for_epsilon(records, build(1.0), epsilon))
