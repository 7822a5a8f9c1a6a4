"""An empirical privacy audit of a silo's DP-SGD: gradient canaries, a membership test on what
training releases, and a statistical lower bound on epsilon
(docs/privacy.md#auditing-the-guarantee)."""

from .bound import audit_bound, p_value
from .canaries import DiracCanaries, Guesses, guess_membership
from .run import AuditResult, AuditSettings, noise_for_epsilon, run_audit

__all__ = ["AuditResult", "AuditSettings", "DiracCanaries", "Guesses", "audit_bound",
           "guess_membership", "noise_for_epsilon", "p_value", "run_audit"]
