"""Silos that differ (simulation): each its own epsilon, delta, batch size and record count.

A deployed silo sets these in its own silo file (docs/deployment.md). In simulation one
operator plays every silo, and these run-config keys give each silo its values
(docs/heterogeneous-silos.md):

- ``silo-epsilons``: empty (every silo ``epsilon``), a preset (``dist1`` .. ``dist9``, the
  per-silo budgets of Robust-HDP's experiments, paper 002 Table 7) or one value per silo;
- ``silo-deltas``, ``silo-samples``: empty or one value per silo;
- ``silo-batch-sizes``: empty (the server's ``batch-size``), ``paper`` (paper 002's per-silo
  batch sizes) or one value per silo;
- ``lying-silos``: silos (partition ids) that tell the server ``lie-factor`` times their real
  budget while calibrating their noise for the real one: the falsified-budget attack.

A preset has 20 values (the paper's 20 silos); with more silos, silo i takes value i mod 20.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from .paper_budgets import DISTRIBUTIONS, PAPER_BATCH_SIZES

Number = TypeVar("Number", int, float)

#: Named per-silo value lists, by run-config key.
PRESETS: Mapping[str, Mapping[str, Sequence[float]]] = {
    "silo-epsilons": DISTRIBUTIONS,
    "silo-batch-sizes": {"paper": PAPER_BATCH_SIZES},
}


def per_silo_values(key: str, spec: str, count: int,
                    cast: Callable[[str], Number]) -> tuple[Number, ...] | None:
    """The ``count`` values of per-silo key ``key`` (silo i's is item i), or None when
    ``spec`` is empty (every silo the run's value). ValueError says what is wrong, naming
    ``key``: an unknown preset, a value that is not a positive ``cast``, a list whose length
    is not ``count``."""
    text = spec.strip().lower()
    if not text:
        return None
    presets = PRESETS.get(key, {})
    if text in presets:
        preset = presets[text]
        return tuple(cast(str(preset[i % len(preset)])) for i in range(count))
    named = f" or a preset ({', '.join(presets)})" if presets else ""
    try:
        values = tuple(cast(part.strip()) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{key} = {spec!r}: expected one {cast.__name__} per silo, "
                         f"comma-separated{named}") from None
    if any(not value > 0 for value in values):
        raise ValueError(f"{key} = {spec!r}: every value must be positive")
    if len(values) != count:
        raise ValueError(f"{key} = {spec!r} gives {len(values)} values for {count} silos")
    return values


def partition_list(key: str, spec: str, count: int) -> frozenset[int]:
    """Partition ids listed in ``spec`` (comma-separated), each below ``count``."""
    text = spec.strip()
    if not text:
        return frozenset()
    try:
        ids = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{key} = {spec!r}: expected comma-separated partition ids") from None
    outside = sorted(i for i in ids if not 0 <= i < count)
    if outside:
        raise ValueError(f"{key} = {spec!r}: partitions {outside} are not in 0..{count - 1}")
    return ids
