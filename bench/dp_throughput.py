"""DP-SGD throughput: our silo training against plain loops, in one process on the same data.

Contenders (samples per second, one thread, best of several interleaved repeats):
  torch-tensors    non-private SGD indexing tensors directly (the hardware limit)
  torch-loader     non-private SGD through a DataLoader, as most users write it
  opacus-default   Opacus make_private with its defaults (hooks, Poisson DPDataLoader)
  ours-<engine>    dpcfl_flwr.training.train_dp with each per-sample engine

  python bench/dp_throughput.py [--model cnn|resnet18|both] [--repeats 3] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402
from dpcfl_flwr.models import build_model  # noqa: E402
from dpcfl_flwr.training import DPSGDConfig, train_dp  # noqa: E402

warnings.filterwarnings("ignore")
SIZES = {"cnn": {"n": 2048, "shape": (1, 28, 28)}, "resnet18": {"n": 192, "shape": (3, 32, 32)}}


def _data(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n, shape = SIZES[model]["n"], SIZES[model]["shape"]
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def torch_tensors(name, x, y, batch):
    model = build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    perm = torch.randperm(x.shape[0])
    start = time.perf_counter()
    for i in range(0, x.shape[0], batch):
        idx = perm[i:i + batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return x.shape[0] / (time.perf_counter() - start)


def torch_loader(name, x, y, batch):
    model = build_model(name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    start = time.perf_counter()
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return x.shape[0] / (time.perf_counter() - start)


def opacus_default(name, x, y, batch):
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    model = build_model(name, seed=0)
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
        model = build_model(name, seed=0)
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


def measure(name: str, batch: int, repeats: int) -> dict[str, float]:
    x, y = _data(name)
    runs: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    for _ in range(repeats):  # interleaved, so machine noise hits all contenders alike
        for key, fn in CONTENDERS.items():
            runs[key].append(fn(name, x, y, batch))
    return {k: max(v) for k, v in runs.items()} | {
        f"{k}:median": statistics.median(v) for k, v in runs.items()}


def table(name: str, batch_label: str, best: dict[str, float]) -> str:
    base_np, base_op = best["torch-tensors"], best["opacus-default"]
    lines = [f"| {name} | {batch_label} | {k} | {best[k]:,.0f} | {best[k] / base_np:.2f} | "
             f"{best[k] / best['torch-loader']:.2f} | {best[k] / base_op:.2f} |"
             for k in CONTENDERS]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="both", choices=["cnn", "resnet18", "both"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    header = ("| model | batch | contender | samples/s (best) | / torch-tensors | / torch-loader |"
              " / opacus-default |\n|---|---|---|---|---|---|---|")
    rows = []
    for name in (["cnn", "resnet18"] if args.model == "both" else [args.model]):
        n = SIZES[name]["n"]
        for batch, label in ((32, "32"), (n, f"full ({n})")):
            rows.append(table(name, label, measure(name, batch, args.repeats)))
    body = (f"Threads per process: {args.threads}. Best of {args.repeats} interleaved repeats; "
            "the same random data for every contender.\n\n" + header + "\n" + "\n".join(rows))
    publish("DP-SGD throughput", body, append=not args.no_append)


if __name__ == "__main__":
    main()
