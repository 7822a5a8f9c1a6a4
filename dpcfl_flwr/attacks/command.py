"""``dpcfl attack dlg``: the DLG gradient-inversion attack on a model of yours (docs/attacks.md).

It takes one record (or a few) of a dataset, computes the gradient a silo training the model
on them would release, privatises it as asked, attacks it at every noise level given, and
writes ``dlg.png`` (original against reconstructions), ``dlg.json`` and ``dlg.md`` (the MSE
per noise level) to ``--out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from ..data import DataError, load_dataset, normalisation
from ..models import MODEL_NAMES, build_model, count_parameters
from ..silo.kept_model import load_silo_model
from .dlg import ACTIVATIONS, PRIVATISERS, attack_model
from .sweep import markdown_table, random_image_mse, run_sweep, write_report

attack_app = typer.Typer(help="Empirical privacy checks: attacks on what a silo releases.",
                         no_args_is_help=True)
console = Console()
errors = Console(stderr=True, soft_wrap=True)
# Above this many parameters one L-BFGS evaluation (a double backward pass) takes seconds.
LARGE_MODEL = 1_000_000


def _stop(problem: str) -> None:
    errors.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)
    raise typer.Exit(code=2)


def _numbers(text: str, option: str, kind: type[int] | type[float]) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected a comma-separated list of "
                         f"{'integers' if kind is int else 'numbers'}") from None
    if not values:
        raise ValueError(f"{option} is empty")
    return values


def load_attacked_model(path: Path, name: str, num_classes: int,
                        in_channels: int) -> tuple[nn.Module, str]:
    """The model of ``path``: a silo's model file (silo_model.py) or a results directory's
    ``models/cluster-<m>.pt`` (a state dict of a ``name`` model); with a line describing it."""
    try:
        silo = load_silo_model(path)
    except (ValueError, KeyError):
        pass
    else:
        meta = silo.metadata
        return silo.model, (f"silo model {path.name}: run {meta.get('run_id')}, round "
                            f"{meta.get('round')}, cluster {meta.get('cluster')}, "
                            f"dataset {meta.get('dataset')}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{path}: neither a silo model file nor a torch state dict "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{path}: neither a silo model file nor a torch state dict")
    model = build_model(name, num_classes=num_classes, in_channels=in_channels)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"{path}: not the state dict of a {name} model with {in_channels} "
                         f"input channel(s) and {num_classes} classes (is --model right?): "
                         f"{first}") from None
    return model.eval(), f"state dict {path.name} ({name})"


def _records(dataset: str, data_dir: Path | None, split: str,
             indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chosen records as pixels in [0, 1] ``(B, C, H, W)``, their labels, the classes."""
    train, test = load_dataset(dataset, data_dir)
    images = train if split == "train" else test
    bad = [i for i in indices if not 0 <= i < len(images.labels)]
    if bad:
        raise ValueError(f"--index {bad[0]} is outside the {dataset} {split} split "
                         f"(0 .. {len(images.labels) - 1})")
    pixels = torch.from_numpy(images.images[indices]).float() / 255.0
    return pixels, torch.from_numpy(images.labels[indices]), images.num_classes


@attack_app.command("dlg")
def dlg(
    out: Annotated[Path, typer.Option(
        "--out", file_okay=False, help="Directory for dlg.png, dlg.json and dlg.md.")],
    dataset: Annotated[str, typer.Option(help="fmnist, mnist or cifar10.")] = "fmnist",
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", file_okay=False,
        help="The dataset's directory (fmnist is found by itself).")] = None,
    split: Annotated[str, typer.Option(help="train or test.")] = "train",
    index: Annotated[str, typer.Option(
        help="The record attacked; a comma list attacks one batch.")] = "0",
    model_name: Annotated[str, typer.Option(
        "--model", help=f"{', '.join(MODEL_NAMES)}.")] = "cnn",
    model_file: Annotated[Path | None, typer.Option(
        "--model-file", exists=True, dir_okay=False,
        help="Attack this trained model: a silo's *.model.pt or a results "
             "models/cluster-<m>.pt (default: a fresh --model drawn with --seed).")] = None,
    activation: Annotated[str, typer.Option(
        help="sigmoid: the fresh CNN with sigmoids, as in the DLG paper (attack demo only)."
    )] = "relu",
    privatiser: Annotated[str, typer.Option(help="none, dpsgd or dprivacy.")] = "none",
    noise: Annotated[str, typer.Option(
        help="z for dpsgd, v for dprivacy; a comma list sweeps: 0,0.01,0.1,1.")] = "0",
    clip: Annotated[float, typer.Option(help="DP-SGD's clipping norm C.")] = 1.0,
    iterations: Annotated[int, typer.Option(
        help="L-BFGS steps of the attack (20 evaluations each).")] = 50,
    seed: Annotated[int, typer.Option(
        help="Seeds the noise, the dummies and a fresh model.")] = 0,
) -> None:
    """Run DLG (Zhu et al. 2019) on the gradient a silo would release for a record."""
    problems = []
    if privatiser not in PRIVATISERS:
        problems.append(f"--privatiser {privatiser!r}: expected one of {', '.join(PRIVATISERS)}")
    if activation not in ACTIVATIONS:
        problems.append(f"--activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}")
    if activation != "relu" and (model_file is not None or model_name != "cnn"):
        problems.append("--activation sigmoid builds a fresh CNN; a --model-file or another "
                        "--model is attacked with the activation it was trained with")
    if model_name not in MODEL_NAMES:
        problems.append(f"--model {model_name!r}: expected one of {', '.join(MODEL_NAMES)}")
    if split not in ("train", "test"):
        problems.append(f"--split {split!r}: expected train or test")
    if iterations < 1:
        problems.append(f"--iterations {iterations}: expected at least 1")
    if not clip > 0:
        problems.append(f"--clip {clip}: expected a clipping norm > 0")
    try:
        noises = [float(v) for v in _numbers(noise, "--noise", float)]
        indices = [int(v) for v in _numbers(index, "--index", int)]
    except ValueError as exc:
        problems.append(str(exc))
        noises, indices = [], []
    if any(v < 0 for v in noises):
        problems.append(f"--noise {noise!r}: noise levels must be >= 0")
    if privatiser == "none" and noises != [0.0]:
        problems.append("--noise needs --privatiser dpsgd or dprivacy (none adds no noise)")
    if problems:
        for problem in problems[:-1]:
            errors.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)
        _stop(problems[-1])
    torch.set_num_threads(1)  # a second thread buys little on a model this size
    try:
        pixels, labels, classes = _records(dataset.strip().lower(), data_dir, split, indices)
        channels = pixels.shape[1]
        if model_file is not None:
            model, described = load_attacked_model(model_file, model_name, classes, channels)
        else:
            model = attack_model(model_name, classes, channels, activation, seed)
            described = f"fresh {model_name} ({activation}, seed {seed})"
        model(torch.zeros((1, *pixels.shape[1:])))
    except (DataError, ValueError, OSError) as exc:
        _stop(str(exc))
        return
    except RuntimeError as exc:
        _stop(f"the model does not take {dataset} records of shape {tuple(pixels.shape[1:])}: "
              f"{str(exc).splitlines()[0]}")
        return
    _attack(out, model, described, pixels, labels, classes, dataset, privatiser, noises, clip,
            iterations, seed, indices, split)


def _attack(out: Path, model: nn.Module, described: str, pixels: torch.Tensor,
            labels: torch.Tensor, classes: int, dataset: str, privatiser: str,
            noises: list[float], clip: float, iterations: int, seed: int, indices: list[int],
            split: str) -> None:
    parameters = count_parameters(model)
    console.print(f"DLG on {described}, {parameters:,} parameters; {dataset} {split} "
                  f"record(s) {indices}; privatiser {privatiser}, noise {noises}",
                  highlight=False)
    if parameters > LARGE_MODEL:
        console.print(f"note: {parameters:,} parameters make each attack step slow "
                      "(minutes); try --iterations 5 first", highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total} distance {task.fields[distance]}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        tasks = {v: bar.add_task(f"{privatiser} noise={v:g}", total=iterations, distance="-")
                 for v in noises}

        def advance(_: str, noise_level: float, step: int, distance: float) -> None:
            bar.update(tasks[noise_level], completed=step, distance=f"{distance:.3g}")
        rows = run_sweep(model, pixels, labels, normalisation(dataset), privatiser, noises,
                         clip=clip, iterations=iterations, seed=seed, num_classes=classes,
                         progress=advance)
    setting = {"model": described, "dataset": dataset, "split": split, "indices": indices,
               "privatiser": privatiser, "noise": noises, "clip": clip,
               "iterations": iterations, "seed": seed}
    paths = write_report(rows, pixels, out, setting, f"DLG on {described}")
    console.print(markdown_table(rows, random_image_mse(pixels, 0)), highlight=False,
                  markup=False, soft_wrap=True)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)
