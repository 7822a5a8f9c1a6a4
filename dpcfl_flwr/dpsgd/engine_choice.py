"""Which per-sample engine ``grad_sample_mode = "auto"`` gives a model, and why.

The candidates are the engines that clip every record's gradient to the clip norm exactly,
whatever the weights (the server chooses them, docs/threat-model.md#the-server-chooses-the-weights):
each forms a record's norm and its clipped contribution from the same numbers.

- ``layerwise``, by rule, whenever it has a rule for every trainable layer: measured fastest on
  every model it supports (bench/RESULTS.md#dp-sgd-throughput).
- Otherwise Opacus ``hooks`` or ``functorch``, by a short measurement on the first chunk of
  records (one warm-up and three timed clipped sums each), once per model shape: the result is
  cached on disk (:func:`cache_path`) under the model's architecture signature, the chunk's
  shape, and the torch and Opacus versions. A cache that cannot be read or parsed is ignored
  (and rewritten).

Opacus' ghost clipping is never a candidate: its second backward pass recomputes each record's
gradient from the clip-scaled loss, whose rounding differs from the first pass's, so a record
whose back-propagated gradient cancels (weights can arrange it) is "clipped" by a norm it does
not have; tests/test_engine_choice.py shows one record contributing ~1e8 at clip 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..files import write_atomically
from .per_sample import ClippedSumEngine, OpacusEngine, layerwise_supported

logger = logging.getLogger(__name__)

#: The engines a measurement chooses between, for models the layerwise engine cannot take.
MEASURED = ("hooks", "functorch")
_TIMED_REPEATS = 3


@dataclass(frozen=True)
class EngineChoice:
    """The engine ``auto`` picked (``layerwise``, ``hooks`` or ``functorch``) and the reason."""

    mode: str
    reason: str


def cache_path() -> Path:
    """``$DPCFL_ENGINE_CACHE`` if set, else ``$XDG_CACHE_HOME/dpcfl_flwr/engine_choice.json``
    (``~/.cache`` without XDG_CACHE_HOME)."""
    explicit = os.environ.get("DPCFL_ENGINE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpcfl_flwr" / "engine_choice.json"


def signature(model: nn.Module, x: torch.Tensor) -> str:
    """A key for everything the engines' speed depends on: the architecture (module tree,
    every parameter's name, shape and trainability), the chunk's shape and dtype, and the
    torch and Opacus versions. Weights take no part: they change every round."""
    import opacus

    parts = [repr(model), str(tuple(x.shape)), str(x.dtype), torch.__version__,
             opacus.__version__]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
              for name, p in model.named_parameters()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def by_rule(model: nn.Module) -> EngineChoice | None:
    """The layerwise engine when it has a rule for every trainable layer; None when only a
    measurement can tell."""
    if layerwise_supported(model):
        return EngineChoice("layerwise", "it has a rule for every trainable layer, and is "
                            "measured fastest on every model it supports")
    return None


def choose(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> EngineChoice:
    """The engine for ``model``: layerwise by rule, else the faster of Opacus' hooks and
    functorch on the chunk (``x``, ``y``), from the cache when this shape was measured."""
    known = by_rule(model)
    if known is not None:
        return known
    key = signature(model, x)
    cached = _read_cache().get(key)
    if cached in MEASURED:
        return EngineChoice(cached, f"measured fastest for this model shape earlier (cache "
                            f"{cache_path()})")
    timings = {mode: _seconds(model, mode, x, y, clip) for mode in MEASURED}
    fastest = min(timings, key=lambda mode: timings[mode])
    _write_cache(key, fastest)
    measured = ", ".join(f"{mode} {1000 * t:.1f} ms" for mode, t in timings.items())
    return EngineChoice(fastest, f"a layer has no layerwise rule; measured per chunk of "
                        f"{x.shape[0]}: {measured} (cached in {cache_path()})")


def _seconds(model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor,
             clip: float) -> float:
    """Median seconds of one clipped sum with the Opacus engine ``mode``, after a warm-up; a
    mode that fails on this model counts as infinitely slow."""
    engine: ClippedSumEngine | None = None
    try:
        engine = OpacusEngine(model, mode)
        engine.clipped_sum(x, y, clip)
        times = []
        for _ in range(_TIMED_REPEATS):
            start = time.perf_counter()
            engine.clipped_sum(x, y, clip)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    except Exception as error:  # noqa: BLE001 - any failure rules the mode out
        logger.info("Opacus %s cannot run this model (%s); not a candidate", mode, error)
        return float("inf")
    finally:
        if engine is not None:
            engine.close()


def _read_cache() -> dict[str, str]:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("ignoring the engine cache %s: %s", path, error)
        return {}
    if not isinstance(data, dict):
        logger.warning("ignoring the engine cache %s: not a JSON object", path)
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write_cache(key: str, mode: str) -> None:
    """Adds ``key`` -> ``mode`` (atomically: a concurrent reader sees the old file or the new
    one); a cache that cannot be written only costs the next process a measurement."""
    path = cache_path()
    data = _read_cache()
    data[key] = mode
    text = json.dumps(data, indent=1, sort_keys=True).encode()
    try:  # a speed hint: a write lost in a crash is measured again
        write_atomically(path, lambda handle: handle.write(text), durable=False, mode=0o644)
    except OSError as error:
        logger.warning("could not write the engine cache %s: %s", path, error)
