"""DP-SGD throughput: our silo training against plain loops, in one process on the same data.

Contenders (samples per second, one thread, several interleaved repeats; each repeat's ratios
are taken within that repeat and their median is reported next to the best run's figures):
  torch-tensors    non-private SGD indexing tensors directly (the hardware limit)
  torch-loader     non-private SGD through a DataLoader, as most users write it
  opacus-default   Opacus make_private with its defaults (hooks, Poisson DPDataLoader)
  ours-<engine>    dpcfl_flwr.dpsgd.training.train_dp with each per-sample engine

Whole loops last about a second on the CNN, so a burst of machine noise moves a best-of ratio
by 10%. The paired-steps section is the steadier figure: one of our DP-SGD steps and one
non-private SGD step alternate on the same Poisson batches, hundreds of times, after warm-up.

  python bench/dp_throughput.py [--model cnn|resnet18|mlp|both] [--repeats 5] [--paired-steps 600]
                                [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.dpsgd.training import DPSGDConfig, DPSGDStepper, train_dp  # noqa: E402
from dpcfl_flwr.models import ModelSpec, build, build_model  # noqa: E402

warnings.filterwarnings("ignore")
SIZES = {"cnn": {"n": 2048, "shape": (1, 28, 28)}, "resnet18": {"n": 192, "shape": (3, 32, 32)},
         "mlp": {"n": 4096, "shape": (18,)}}  # the MLP on a table of 18 numbers (RAND HIE's)


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


def opacus_default(name, x, y, batch):
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0)
    seen = 0
    start = time.perf_counter()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=min(batch, 256),
                            optimizer=opt) as physical:
        for xb, yb in physical:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            seen += xb.shape[0]
    return seen / (time.perf_counter() - start)


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
    "opacus-default": opacus_default, "ours-hooks": ours("hooks"),
    "ours-functorch": ours("functorch"), "ours-layerwise": ours("layerwise"),
}


def measure(name: str, batch: int, repeats: int) -> dict[str, list[float]]:
    x, y = _data(name)
    runs: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    for _ in range(repeats):  # interleaved, so machine noise hits all contenders alike
        for key, fn in CONTENDERS.items():
            runs[key].append(fn(name, x, y, batch))
    return runs


def _median_ratio(runs: dict[str, list[float]], key: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(runs[key], runs[base], strict=True))


def table(name: str, batch_label: str, runs: dict[str, list[float]]) -> str:
    lines = []
    for key in CONTENDERS:
        ratios = [_median_ratio(runs, key, base)
                  for base in ("torch-tensors", "torch-loader", "opacus-default")]
        lines.append(f"| {name} | {batch_label} | {key} | {max(runs[key]):,.0f} | "
                     f"{statistics.median(runs[key]):,.0f} | "
                     + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(lines)


def paired_steps(name: str, batch: int, steps: int, warmup: int = 50) -> dict[str, float]:
    """Seconds spent in our DP-SGD steps and in non-private SGD steps on the same Poisson
    batches, alternating step by step (which goes first alternates too)."""
    x, y = _data(name)
    private = _model(name)
    stepper = DPSGDStepper(private, DPSGDConfig(1.0, 1.0, 0.01, batch), float(batch))
    sampler = torch.Generator().manual_seed(1)
    spent = {"ours": 0.0, "non-private": 0.0}
    contenders = {"ours": stepper.step, "non-private": plain_sgd(name)}
    try:
        for step in range(warmup + steps):
            mask = torch.rand(x.shape[0], generator=sampler) < batch / x.shape[0]
            xb, yb = x[mask], y[mask]
            for key in (("ours", "non-private") if step % 2 else ("non-private", "ours")):
                start = time.perf_counter()
                contenders[key](xb, yb)
                if step >= warmup:
                    spent[key] += time.perf_counter() - start
    finally:
        stepper.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="both", choices=["cnn", "resnet18", "mlp", "both"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paired-steps", type=int, default=600,
                        help="paired steps at batch 32 per model (0: skip)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = ("| model | batch | contender | samples/s (best) | samples/s (median) |"
              " / torch-tensors | / torch-loader | / opacus-default |\n"
              "|---|---|---|---|---|---|---|---|")
    models = ["cnn", "resnet18"] if args.model == "both" else [args.model]
    rows, paired = [], []
    for name in models:
        n = SIZES[name]["n"]
        for batch, label in ((32, "32"), (n, f"full ({n})")):
            rows.append(table(name, label, measure(name, batch, args.repeats)))
        if args.paired_steps:
            spent = paired_steps(name, 32, args.paired_steps)
            paired.append(f"| {name} | {args.paired_steps} | {spent['non-private']:.2f} | "
                          f"{spent['ours']:.2f} | {spent['non-private'] / spent['ours']:.2f} |")
    body = (f"Threads per process: {args.threads}. {args.repeats} interleaved repeats; the same "
            "random data for every contender. Ratio columns: median over repeats of the ratio "
            "within each repeat.\n\n" + header + "\n" + "\n".join(rows))
    if paired:
        body += ("\n\nPaired steps at batch 32 (Poisson batches, one of our DP-SGD steps and one "
                 "non-private SGD step alternating, after 50 warm-up pairs):\n\n"
                 "| model | steps | non-private (s) | ours (s) | ours / non-private throughput |"
                 "\n|---|---|---|---|---|\n" + "\n".join(paired))
    title = "DP-SGD throughput" if args.model == "both" else f"DP-SGD throughput ({args.model})"
    publish(title, body, append=not args.no_append)


if __name__ == "__main__":
    main()
