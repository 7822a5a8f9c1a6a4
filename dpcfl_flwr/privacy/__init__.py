"""Privacy accounting: SGM RDP, PLD (dp-accounting), calibration, budget split, exponential
mechanism, ledger; the Euclidean Laplace mechanism (d-privacy) on released models."""

from .accountants import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    Accountant,
    AccountantName,
    accountant_named,
)
from .budget import BudgetMode, BudgetSplit, NoisePlan, plan_noise, split_budget
from .calibration import calibrate_noise_multiplier, schedule_epsilon
from .dprivacy import (
    Sanitized,
    euclidean_laplace,
    euclidean_laplace_log_density,
    sanitize_update,
)
from .history import History
from .ledger import (
    DPrivacyRelease,
    GaussianSteps,
    PrivacyBudget,
    PrivacyLedger,
    Selection,
    ledger_lock,
)
from .metrics import LOSS_BOUND, metric_release_cost, noisy_evaluation
from .pld import pld_epsilon
from .rdp import DEFAULT_ORDERS, Conversion, rdp_to_dp, sgm_rdp
from .schedule import (
    FULL_BATCH,
    GaussianPhase,
    Schedule,
    round_phase,
    single_stage_schedule,
    steps_per_round,
    two_stage_schedule,
)
from .selection import (
    accuracy_sensitivity,
    select_cluster,
    selection_probabilities,
    selection_rdp,
)

__all__ = [
    "ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "Accountant", "AccountantName", "History",
    "accountant_named", "pld_epsilon",
    "DEFAULT_ORDERS", "FULL_BATCH", "BudgetMode", "BudgetSplit", "Conversion", "DPrivacyRelease",
    "GaussianPhase", "LOSS_BOUND", "GaussianSteps", "NoisePlan", "PrivacyBudget", "PrivacyLedger",
    "Sanitized", "Schedule", "Selection",
    "accuracy_sensitivity", "calibrate_noise_multiplier", "euclidean_laplace",
    "euclidean_laplace_log_density", "ledger_lock", "sanitize_update",
    "metric_release_cost", "noisy_evaluation", "plan_noise", "rdp_to_dp",
    "round_phase", "schedule_epsilon", "select_cluster", "selection_probabilities",
    "selection_rdp", "sgm_rdp", "single_stage_schedule", "split_budget", "steps_per_round",
    "two_stage_schedule",
]
