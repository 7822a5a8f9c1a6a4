"""The choices behind the layerwise DP-SGD engine, each measured on the paper's CNN (batch 32).

1. Per-sample conv weight gradients: unfold + bmm (what Opacus' hooks do) against one grouped
   weight-gradient convolution (the batch folded into groups), for both CNN conv layers.
2. Per-sample norms of the deep ResNet-18 layers: materialised gradients against Gram
   matrices (ghost norms), where few output positions meet wide filters.
3. Threads per training process: DP-SGD samples/s with 1 and 2 intra-op threads (this VM has
   2 cores shared with other tenants).

  python bench/engine_choices.py [--no-append]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402

BATCH = 32


def millis(fn: Callable[[], object], repeats: int = 60) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return 1000 * best


def conv_choices() -> list[str]:
    rows = []
    for c_in, c_out, size in ((1, 16, 28), (16, 32, 14)):
        a = torch.randn(BATCH, c_in, size, size)
        g = torch.randn(BATCH, c_out, size, size)

        def unfold_bmm() -> torch.Tensor:
            columns = F.unfold(a, 5, 1, 2, 1)
            return torch.bmm(g.reshape(BATCH, c_out, -1), columns.transpose(1, 2))

        def grouped() -> torch.Tensor:
            return conv2d_weight(a.reshape(1, BATCH * c_in, size, size),
                                 (BATCH * c_out, c_in, 5, 5),
                                 g.reshape(1, BATCH * c_out, size, size), 1, 2, 1, BATCH)

        def grouped_native() -> torch.Tensor:  # the same without oneDNN
            with torch.backends.mkldnn.flags(enabled=False):
                return grouped()

        def summed() -> torch.Tensor:  # the non-private weight gradient, for scale
            return conv2d_weight(a, (c_out, c_in, 5, 5), g, 1, 2, 1, 1)

        diff = (unfold_bmm().reshape(-1) - grouped().reshape(-1)).abs().max().item()
        rows.append(f"| conv {c_in}->{c_out}, {size}x{size} | {millis(unfold_bmm):.2f} | "
                    f"{millis(grouped):.2f} | {millis(grouped_native):.2f} | "
                    f"{millis(summed):.2f} | {diff:.1e} |")
    return rows


def ghost_choices() -> list[str]:
    rows = []
    for c, size in ((128, 4), (256, 2), (512, 1)):  # ResNet-18 layers 2-4 on 32x32 inputs
        a = torch.randn(BATCH, c, size, size)
        g = torch.randn(BATCH, c, size, size)

        def materialise() -> torch.Tensor:
            weight = conv2d_weight(a.reshape(1, BATCH * c, size, size), (BATCH * c, c, 3, 3),
                                   g.reshape(1, BATCH * c, size, size), 1, 1, 1, BATCH)
            return weight.reshape(BATCH, -1).pow(2).sum(1)

        def ghost() -> torch.Tensor:
            columns = F.unfold(a, 3, 1, 1, 1)
            grads = g.reshape(BATCH, c, -1)
            return (torch.bmm(columns.transpose(1, 2), columns)
                    * torch.bmm(grads.transpose(1, 2), grads)).sum((1, 2))

        diff = ((materialise() - ghost()).abs() / ghost().abs()).max().item()
        rows.append(f"| conv {c}->{c} 3x3 at {size}x{size} | {millis(materialise, 10):.1f} | "
                    f"{millis(ghost, 10):.2f} | {diff:.1e} |")
    return rows


_THREADS = """
import sys, time, torch
from dpcfl_flwr.models import build_model
from dpcfl_flwr.dpsgd.training import DPSGDConfig, train_dp
torch.set_num_threads(int(sys.argv[1]))
x, y = torch.randn(2048, 1, 28, 28), torch.randint(0, 10, (2048,))
best = 0.0
for _ in range(3):
    start = time.perf_counter()
    result = train_dp(build_model("cnn", seed=0), x, y, DPSGDConfig(1.0, 1.0, 0.01, 32))
    best = max(best, result.sampled_examples / (time.perf_counter() - start))
print(best)
"""


def thread_choices() -> list[str]:
    rows = []
    for threads in (1, 2):
        out = subprocess.run([sys.executable, "-c", _THREADS, str(threads)], check=True,
                             capture_output=True, text=True).stdout
        rows.append(f"| {threads} | {float(out.strip().splitlines()[-1]):,.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="TF32 acceleration")
    body = (
        "Per-sample conv weight gradients, batch 32, one thread (ms per call, best of 3):\n\n"
        "| layer | unfold + bmm | grouped conv (oneDNN) | grouped conv (native) | "
        "summed (non-private) | max abs diff |\n|---|---|---|---|---|---|\n"
        + "\n".join(conv_choices()) +
        "\n\nPer-sample norms of ResNet-18's deep layers, batch 32 (ms per call):\n\n"
        "| layer | materialised | Gram (ghost) | max rel. diff |\n|---|---|---|---|\n"
        + "\n".join(ghost_choices()) +
        "\n\nThreads per training process (CNN, batch 32, DP-SGD samples/s, best of 3):\n\n"
        "| threads | samples/s |\n|---|---|\n" + "\n".join(thread_choices()))
    publish("Choices inside the layerwise engine", body, append=not args.no_append)


if __name__ == "__main__":
    main()
