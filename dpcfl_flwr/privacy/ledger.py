"""A silo's privacy ledger: every mechanism it ran, composed in RDP (or, with the ``pld``
accountant, by privacy loss distributions, privacy/pld.py), converted once.

Modelled on Opacus' accountants (a plain history list, saved and restored), but it also
records exponential-mechanism selections and lives in a JSON file the silo owns, written
atomically, so that neither a crash nor a restart can reset the budget (ARCHITECTURE: the
server is not trusted with privacy).

Releases through the Euclidean Laplace mechanism (d-privacy, paper 004) are kept in the same
history but in their own units, leakage per unit of distance: they compose by addition
(paper 004 Thm 3.1, :meth:`PrivacyLedger.dprivacy_leakage`) and never enter the (eps, delta)
figures, which they have no conversion into (docs/dprivacy.md#the-ledger).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..files import write_atomically
from .accountants import DEFAULT_ACCOUNTANT, AccountantName, accountant_named
from .history import History
from .rdp import DEFAULT_CONVERSION, DEFAULT_ORDERS, Conversion, sgm_rdp
from .selection import selection_rdp

LEDGER_FORMAT = 1


@dataclass(frozen=True)
class GaussianSteps:
    """``steps`` DP-SGD steps at Poisson rate ``sample_rate`` with noise multiplier z."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    round: int | None = None
    kind: Literal["gaussian"] = "gaussian"

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0 or not 0 < self.sample_rate <= 1 or self.steps < 0:
            raise ValueError(f"invalid Gaussian entry {self}")

    def rdp(self, orders: Sequence[float]) -> np.ndarray:
        return sgm_rdp(self.sample_rate, self.noise_multiplier, self.steps, orders)


@dataclass(frozen=True)
class Selection:
    """``count`` eps-DP exponential-mechanism selections."""

    epsilon: float
    count: int = 1
    round: int | None = None
    kind: Literal["selection"] = "selection"

    def __post_init__(self) -> None:
        if self.epsilon <= 0 or self.count < 0:
            raise ValueError(f"invalid selection entry {self}")

    def rdp(self, orders: Sequence[float]) -> np.ndarray:
        return selection_rdp(self.epsilon, orders) * self.count


@dataclass(frozen=True)
class DPrivacyRelease:
    """One model released through the Euclidean Laplace mechanism (paper 004 Alg. 2).

    ``epsilon`` is per unit of Euclidean distance in parameter space (``inf`` when nothing
    was added); ``leakage`` is ``epsilon * ||delta||`` = n / v, the indistinguishability of
    points within the update's norm. Not an (eps, delta)-DP cost: see the module docstring.
    """

    epsilon: float
    leakage: float
    round: int | None = None
    kind: Literal["dprivacy"] = "dprivacy"

    def __post_init__(self) -> None:
        if not self.epsilon > 0 or not (0 <= self.leakage < math.inf):
            raise ValueError(f"invalid d-privacy entry {self}: need epsilon > 0 (inf allowed) "
                             "and a finite leakage >= 0")


Entry = GaussianSteps | Selection | DPrivacyRelease
DPEntry = GaussianSteps | Selection


@dataclass(frozen=True)
class PrivacyBudget:
    """The (eps, delta) a silo has agreed to spend in total, how RDP is converted, and the
    accountant that measures every spend against it (docs/privacy.md#pld-accounting)."""

    epsilon: float
    delta: float
    conversion: Conversion = DEFAULT_CONVERSION
    accountant: AccountantName = DEFAULT_ACCOUNTANT

    def __post_init__(self) -> None:
        if self.epsilon <= 0 or not 0 < self.delta < 1:
            raise ValueError(f"budget needs epsilon > 0 and 0 < delta < 1, got {self}")
        accountant_named(self.accountant)  # ValueError naming the choices


def _dp_entries(entries: Iterable[Entry]) -> list[DPEntry]:
    """The (eps, delta)-DP mechanisms among ``entries``: d-privacy releases left out."""
    return [e for e in entries if not isinstance(e, DPrivacyRelease)]


def _entry_from_dict(raw: dict[str, Any]) -> Entry:
    kind = raw.get("kind")
    fields = {k: v for k, v in raw.items() if k != "kind"}
    if kind == "gaussian":
        return GaussianSteps(**fields)
    if kind == "selection":
        return Selection(**fields)
    if kind == "dprivacy":
        return DPrivacyRelease(**fields)
    raise ValueError(f"unknown ledger entry kind {kind!r}")


@dataclass
class PrivacyLedger:
    """History of mechanisms; ``meta`` holds the silo's plan (z, schedule) for restarts."""

    entries: list[Entry] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    orders: tuple[float, ...] = DEFAULT_ORDERS

    def record(self, entries: Iterable[Entry]) -> None:
        self.entries.extend(entries)

    def composed(self, other: PrivacyLedger) -> PrivacyLedger:
        """The ledger of running both histories on the same data."""
        return PrivacyLedger([*self.entries, *other.entries], {**self.meta}, self.orders)

    def history(self, extra: Iterable[Entry] = ()) -> History:
        """The (eps, delta)-DP mechanisms recorded (plus hypothetical ``extra`` entries), as
        the accountants read them; d-privacy releases left out."""
        entries = _dp_entries([*self.entries, *extra])
        return History(tuple((e.noise_multiplier, e.sample_rate, e.steps) for e in entries
                             if isinstance(e, GaussianSteps)),
                       tuple((e.epsilon, e.count) for e in entries if isinstance(e, Selection)))

    def rdp(self, extra: Iterable[Entry] = ()) -> np.ndarray:
        """RDP curve of the history (plus hypothetical ``extra`` entries)."""
        return self.history(extra).rdp(self.orders)

    def epsilon(self, delta: float, conversion: Conversion = DEFAULT_CONVERSION,
                extra: Iterable[Entry] = (), accountant: str = DEFAULT_ACCOUNTANT) -> float:
        """eps at ``delta`` of every (eps, delta)-DP mechanism recorded (0 when there is none;
        d-privacy releases do not count), the whole history under one ``accountant``
        (:mod:`.accountants`)."""
        return accountant_named(accountant).epsilon(self.history(extra), delta, conversion,
                                                   self.orders)

    def spent(self, budget: PrivacyBudget) -> float:
        return self.epsilon(budget.delta, budget.conversion, accountant=budget.accountant)

    def would_exceed(self, planned: Iterable[Entry], budget: PrivacyBudget) -> bool:
        """Would running ``planned`` on top of the history spend more than ``budget``?"""
        return self.epsilon(budget.delta, budget.conversion, planned,
                            budget.accountant) > budget.epsilon

    def dprivacy_leakage(self, planned: Iterable[Entry] = ()) -> float:
        """Total d-privacy leakage of the history (plus ``planned``): the leakages add up
        (paper 004 Thm 3.1); every other kind of entry is ignored."""
        return float(sum(e.leakage for e in [*self.entries, *planned]
                         if isinstance(e, DPrivacyRelease)))

    def would_exceed_leakage(self, planned: Iterable[Entry], threshold: float) -> bool:
        """Would releasing ``planned`` take the total d-privacy leakage past ``threshold``
        (the silo's own limit, paper 004 §4.1: a client may skip a round for it)?"""
        return self.dprivacy_leakage(planned) > threshold

    def last_round(self) -> int:
        rounds = [e.round for e in self.entries if e.round is not None]
        return max(rounds, default=0)

    # --- persistence -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "orders": list(self.orders),
            "meta": self.meta,
            "entries": [asdict(e) for e in self.entries],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PrivacyLedger:
        if raw.get("format") != LEDGER_FORMAT:
            raise ValueError(f"unsupported ledger format {raw.get('format')!r}")
        orders = tuple(float(a) for a in raw["orders"])
        if not orders or min(orders) <= 1 or not all(math.isfinite(a) for a in orders):
            raise ValueError("ledger orders must be finite and > 1")
        return cls([_entry_from_dict(e) for e in raw["entries"]], dict(raw.get("meta", {})),
                   orders)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash leaves either the old or the new file, never half."""
        text = self.to_json().encode("utf-8")
        write_atomically(path, lambda handle: handle.write(text))

    @classmethod
    def load(cls, path: str | Path) -> PrivacyLedger:
        """Read a ledger; a missing file is a fresh ledger, a damaged one is an error
        (silently starting over would reset the budget)."""
        source = Path(path)
        if not source.exists():
            return cls()
        try:
            return cls.from_json(source.read_text(encoding="utf-8"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"privacy ledger {source} is unreadable ({exc}); refusing to start from an "
                "empty budget. Restore the file or move it away deliberately."
            ) from exc


@contextlib.contextmanager
def ledger_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive OS lock on the ledger at ``path`` for the ``with`` block.

    A silo's load -> check -> charge -> save must not interleave with another handler's (two
    processes of one silo both passed the check and one charge was lost). ``flock`` on a
    sibling ``.lock`` file serialises every holder, in this process or another; the kernel
    releases it when its holder dies, so a crash cannot leave the ledger locked.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
