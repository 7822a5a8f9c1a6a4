"""MR-MTL (mean-regularised multi-task learning; docs/algorithm.md#mr-mtl).

Each silo i keeps a personal model theta_i and minimises f_i(theta_i) + (lambda/2)
||theta_i - theta_bar||^2, theta_bar the uniform mean of the personal models. The server keeps
the personal models (from the silos' DP updates) and sends each silo its model and theta_bar.

``[mrmtl] variant = "correct"`` (default) adds lambda (theta_i - theta_bar) to the privatised
gradient, which is data-independent and so free. ``"authors"`` reproduces the authors' code,
where the term sits in the loss and Opacus' per-sample clipping drops it: the silos then train
exactly as Local does (reported with the result; docs/algorithm.md#mr-mtl).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..config.registry import register
from ..protocol import ANCHOR, WireModel, pack
from .base import Method, MethodParams


class MRMTLParams(MethodParams):
    """``[mrmtl]``: the regulariser's strength lambda and where it is applied."""

    lambda_: float = Field(1.0, ge=0.0, alias="lambda")
    variant: Literal["correct", "authors"] = "correct"


@register
class MRMTL(Method):
    """One "cluster" per silo, its personal model; sized once the silos are known."""

    name = "mrmtl"
    title = "MR-MTL: personal models pulled towards their mean"
    weighs_updates = False  # one silo per model: there is nothing to weigh
    Params = MRMTLParams
    params: MRMTLParams

    def _ensure_models(self) -> None:
        models, slots = self.state.models, max(self.state.silos, default=-1) + 1
        while len(models) < slots:
            models.append(self.state.initial.copy())

    def assign(self, server_round: int, partitions: list[int]) -> dict[int, int]:
        self._ensure_models()
        return {p: p for p in partitions}

    def current_cluster(self, partition: int) -> int:
        self._ensure_models()
        return partition

    def anchor(self) -> np.ndarray:
        """theta_bar: the uniform mean of the silos' personal models."""
        models = self.state.models
        return np.mean([models[p] for p in sorted(self.state.silos)], axis=0).astype(np.float32)

    def silo_settings(self, server_round: int, cluster: int) -> dict[str, Any]:
        return {"prox-lambda": self.params.lambda_, "prox-variant": self.params.variant}

    def extra_models(self, server_round: int) -> dict[str, WireModel]:
        return {ANCHOR: pack(self.anchor())}

    def results(self) -> dict[str, Any]:
        return {"mrmtl_variant": self.params.variant, "mrmtl_lambda": self.params.lambda_}
