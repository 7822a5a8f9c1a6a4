"""DP-SGD throughput: our silo training against plain loops, in one process on the same data.

Contenders (samples per second, one thread, several interleaved repeats; each repeat's ratios
are taken within that repeat and their median is reported next to the best run's figures):
  torch-tensors    non-private SGD indexing tensors directly (the hardware limit)
  torch-loader     non-private SGD through a DataLoader, as most users write it
  opacus-default   Opacus make_private with its defaults (hooks, Poisson DPDataLoader)
  opacus-ghost     Opacus make_private with grad_sample_mode="ghost" (ghost clipping: two
                   backward passes, its DPLossFastGradientClipping criterion)
  ours-<engine>    dpcfl_flwr.dpsgd.training.train_dp with each per-sample engine

Whole loops last about a second on the CNN, so a burst of machine noise moves a best-of ratio
by 10%. The paired-steps section is the steadier figure: one of our DP-SGD steps (auto engine),
one non-private SGD step, one Opacus step with hooks and one with ghost clipping take turns on
the same Poisson batches, many times, after warm-up.

  python bench/dp_throughput.py [--model cnn|resnet18|mlp|both|all] [--repeats 5]
                                [--paired-steps 600] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig, DPSGDStepper, train_dp  # noqa: E402
from dpcfl_flwr.models import ModelSpec, build, build_model  # noqa: E402

warnings.filterwarnings("ignore")
SIZES = {"cnn": {"n": 2048, "shape": (1, 28, 28)}, "resnet18": {"n": 192, "shape": (3, 32, 32)},
         "mlp": {"n": 4096, "shape": (18,)}}  # the MLP on a RAND HIE-sized table


def _model(name: str) -> nn.Module:
    """A fresh model (seed 0) for the records of SIZES[name]: the paper's image models, or
    the table MLP with its default hidden layers."""
    if name == "mlp":
        return build(ModelSpec("mlp", 10, SIZES["mlp"]["shape"]), seed=0)
    return build_model(name, seed=0)


def _data(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n, shape = SIZES[model]["n"], SIZES[model]["shape"]
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def plain_sgd(name: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One non-private SGD step on a fresh model: the hardware limit every loop compares to."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    return step


def torch_tensors(name, x, y, batch):
    step = plain_sgd(name)
    perm = torch.randperm(x.shape[0])
    start = time.perf_counter()
    for i in range(0, x.shape[0], batch):
        idx = perm[i:i + batch]
        step(x[idx], y[idx])
    return x.shape[0] / (time.perf_counter() - start)


def torch_loader(name, x, y, batch):
    step = plain_sgd(name)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    start = time.perf_counter()
    for xb, yb in loader:
        step(xb, yb)
    return x.shape[0] / (time.perf_counter() - start)


def opacus_private(name: str, x: torch.Tensor, y: torch.Tensor, batch: int, mode: str
                   ) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], DataLoader, Any]:
    """One Opacus DP-SGD step (``mode``: hooks or ghost) on a fresh model as make_private sets
    it up, its Poisson data loader and its DP optimizer."""
    from opacus import PrivacyEngine

    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    criterion = nn.CrossEntropyLoss()
    made = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, criterion=criterion, grad_sample_mode=mode)
    if mode == "ghost":  # ghost clipping wraps the loss too: its backward runs both passes
        model, opt, criterion, loader = made
    else:
        model, opt, loader = made

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        criterion(model(xb), yb).backward()
        opt.step()

    return step, loader, opt


def opacus(mode):
    def run(name, x, y, batch):
        from opacus.utils.batch_memory_manager import BatchMemoryManager

        step, loader, opt = opacus_private(name, x, y, batch, mode)
        seen = 0
        start = time.perf_counter()
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=min(batch, 256),
                                optimizer=opt) as physical:
            for xb, yb in physical:
                step(xb, yb)
                seen += xb.shape[0]
        return seen / (time.perf_counter() - start)
    return run


def ours(mode):
    def run(name, x, y, batch):
        model = _model(name)
        config = DPSGDConfig(1.0, 1.0, 0.01, "full" if batch >= x.shape[0] else batch,
                             grad_sample_mode=mode)
        start = time.perf_counter()
        result = train_dp(model, x, y, config)
        return result.sampled_examples / (time.perf_counter() - start)
    return run


CONTENDERS = {
    "torch-tensors": torch_tensors, "torch-loader": torch_loader,
    "opacus-default": opacus("hooks"), "opacus-ghost": opacus("ghost"), "ours-hooks": ours("hooks"),
    "ours-functorch": ours("functorch"), "ours-layerwise": ours("layerwise"),
}


def measure(name: str, batch: int, repeats: int, contenders: list[str]
            ) -> dict[str, list[float]]:
    x, y = _data(name)
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):  # interleaved, so machine noise hits all contenders alike
        for key in contenders:
            runs[key].append(CONTENDERS[key](name, x, y, batch))
    return runs


def _median_ratio(runs: dict[str, list[float]], key: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(runs[key], runs[base], strict=True))


BASES = ("torch-tensors", "torch-loader", "opacus-default", "opacus-ghost")


def table(name: str, batch_label: str, runs: dict[str, list[float]]) -> str:
    lines = []
    for key in runs:
        ratios = [f"{_median_ratio(runs, key, base):.2f}" if base in runs else "-"
                  for base in BASES]
        lines.append(f"| {name} | {batch_label} | {key} | {max(runs[key]):,.0f} | "
                     f"{statistics.median(runs[key]):,.0f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


PAIRED = ("non-private", "ours", "opacus-hooks", "opacus-ghost")


def paired_steps(name: str, batch: int, steps: int) -> tuple[dict[str, float], str]:
    """Seconds spent in each of :data:`PAIRED`'s steps on the same Poisson batches, taking
    turns step by step (the order rotates), after steps // 10 warm-up rounds; and the engine
    our ``auto`` chose."""
    x, y = _data(name)
    stepper = DPSGDStepper(_model(name), DPSGDConfig(1.0, 1.0, 0.01, batch), float(batch))
    contenders = {"non-private": plain_sgd(name), "ours": stepper.step,
                  "opacus-hooks": opacus_private(name, x, y, batch, "hooks")[0],
                  "opacus-ghost": opacus_private(name, x, y, batch, "ghost")[0]}
    sampler = torch.Generator().manual_seed(1)
    spent = dict.fromkeys(PAIRED, 0.0)
    warmup = max(3, steps // 10)
    try:
        for step in range(warmup + steps):
            mask = torch.rand(x.shape[0], generator=sampler) < batch / x.shape[0]
            xb, yb = x[mask], y[mask]
            if xb.shape[0] == 0:
                continue
            turn = step % len(PAIRED)
            for key in PAIRED[turn:] + PAIRED[:turn]:
                start = time.perf_counter()
                contenders[key](xb, yb)
                if step >= warmup:
                    spent[key] += time.perf_counter() - start
    finally:
        stepper.close()
    return spent, stepper.choice.mode if stepper.choice else "?"


def paired_row(name: str, steps: int, spent: dict[str, float], engine: str) -> str:
    ratios = [spent["non-private"] / spent["ours"], spent["opacus-hooks"] / spent["ours"],
              spent["opacus-ghost"] / spent["ours"]]
    return (f"| {name} | {engine} | {steps} | " + " | ".join(f"{spent[k]:.2f}" for k in PAIRED)
            + " | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


#: Paired steps per model by default: ResNet-18-GN's Opacus steps take seconds each.
PAIRED_STEPS = {"cnn": 200, "mlp": 600, "resnet18": 12}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="both",
                        choices=["cnn", "resnet18", "mlp", "both", "all"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paired-steps", type=int, default=None,
                        help="paired steps at batch 32 per model (default: PAIRED_STEPS; 0: skip)")
    parser.add_argument("--batches", default="32,full", help="loop batches: 32, full or both")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="the whole-loop contenders to run (comma-separated; none: '')")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = ("| model | batch | contender | samples/s (best) | samples/s (median) |"
              " / torch-tensors | / torch-loader | / opacus-default | / opacus-ghost |\n"
              "|---|---|---|---|---|---|---|---|---|")
    models = {"both": ["cnn", "resnet18"], "all": ["cnn", "resnet18", "mlp"]}.get(
        args.model, [args.model])
    contenders = [c for c in args.contenders.split(",") if c]
    rows, paired = [], []
    for name in models:
        n = SIZES[name]["n"]
        for label in (b for b in args.batches.split(",") if b and contenders):
            batch = n if label == "full" else int(label)
            label = f"full ({n})" if label == "full" else label
            rows.append(table(name, label, measure(name, batch, args.repeats, contenders)))
        steps = PAIRED_STEPS[name] if args.paired_steps is None else args.paired_steps
        if steps:
            spent, engine = paired_steps(name, 32, steps)
            paired.append(paired_row(name, steps, spent, engine))
    body = f"Threads per process: {args.threads}."
    if rows:
        body += (f" {args.repeats} interleaved repeats; the same random data for every "
                 "contender. Ratio columns: median over repeats of the ratio within each repeat."
                 "\n\n" + header + "\n" + "\n".join(rows))
    if paired:
        body += ("\n\nPaired steps at batch 32 (Poisson batches; one step of each contender in "
                 "turn, the order rotating, after steps/10 warm-up turns; ours is train_dp's "
                 "stepper with the engine auto chose):\n\n"
                 "| model | our engine | steps | non-private (s) | ours (s) | Opacus hooks (s) |"
                 " Opacus ghost (s) | ours / non-private | ours / Opacus hooks |"
                 " ours / Opacus ghost |\n|---|---|---|---|---|---|---|---|---|---|\n"
                 + "\n".join(paired))
    title = ("DP-SGD throughput" if args.model in ("both", "all")
             else f"DP-SGD throughput ({args.model})")
    publish(title, body, append=not args.no_append)


if __name__ == "__main__":
    main()
