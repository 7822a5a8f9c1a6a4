"""Empirical privacy checks: attacks on what a silo releases (docs/attacks.md)."""

from .dlg import (
    ACTIVATIONS,
    PRIVATISERS,
    DlgResult,
    attack_model,
    dlg_attack,
    privatise_dprivacy,
    privatise_dpsgd,
    privatise_none,
    privatised_release,
    psnr,
    reconstruction_error,
    released_gradient,
)

__all__ = [
    "ACTIVATIONS", "PRIVATISERS", "DlgResult", "attack_model", "dlg_attack", "privatise_dpsgd",
    "privatise_dprivacy", "privatise_none", "privatised_release", "psnr",
    "reconstruction_error", "released_gradient",
]
