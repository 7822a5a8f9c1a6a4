"""The default accounting, named once (docs/privacy.md#the-default-accounting).

By default a silo composes *everything* it will run (every Gaussian DP-SGD step, its private
selections, its reserved private evaluations) into one history and converts it to (epsilon,
delta) once, with the tightest bound we can prove: privacy loss distributions, or RDP with
Balle et al.'s conversion where that is smaller (``pld``, which reports the smaller of the
two, :class:`~.accountants.PldAccountant`). Its z is calibrated for that figure, so a run as
planned spends its whole budget (docs/privacy.md#calibrating-z).

The authors' accounting (``split``, ``classic``, ``rdp``: selections and training converted
separately, Mironov's conversion) stays selectable to reproduce their noise levels
(:data:`AUTHORS_ACCOUNTING`); the paper-scale example configs name it.
"""

from __future__ import annotations

from typing import Literal

#: RDP to (epsilon, delta): Mironov 2017 (``classic``) or Balle et al. 2020 (``tight``).
Conversion = Literal["classic", "tight"]
#: How a budget is shared between training and selections (docs/privacy.md, P7 and P8).
BudgetMode = Literal["split", "joint"]
#: The accountants that read a history (:mod:`.accountants`).
AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[AccountantName, ...] = ("rdp", "pld")

DEFAULT_ACCOUNTANT: AccountantName = "pld"
DEFAULT_BUDGET_MODE: BudgetMode = "joint"
DEFAULT_CONVERSION: Conversion = "tight"

#: What a train message, a schedule key or a stored plan that names no accountant means: RDP,
#: the only accountant before there was a choice. Fixed, whatever the default: a run planned
#: before the default changed keeps its key, so a resumed silo keeps its z.
UNNAMED_ACCOUNTANT: AccountantName = "rdp"

#: The authors' accounting, as run-config keys: their noise levels
#: (docs/privacy.md#reference-values).
AUTHORS_ACCOUNTING: dict[str, str] = {"budget-mode": "split", "conversion": "classic",
                                      "accountant": "rdp"}
