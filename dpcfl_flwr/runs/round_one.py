"""Round-1 updates computed in one process, without Flower: the clustering signal on its own.

Used by tests and benchmarks that study the server's clustering step (the paper's Figs. 5
and 9, docs/experiments.md#final-paper) without running a federation; the Flower app
computes the same updates per silo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..data import ClientData
from ..dpsgd.training import DPSGDConfig, train_dp
from ..models import build_model


def flatten_update(update: dict[str, torch.Tensor]) -> np.ndarray:
    """One client's update as a flat float32 vector (the order of the model's state dict)."""
    return torch.cat([v.detach().reshape(-1).float() for v in update.values()]).numpy()


def round_one_updates(
    clients: Sequence[ClientData], model: str, config: DPSGDConfig, init_seed: int,
    noise_seed: int | None = None, on_client_done: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Every client trains the same theta_init for one round; returns the (n, p) updates.

    ``noise_seed`` makes sampling and noise reproducible (client i uses noise_seed + 2 i).
    """
    start = build_model(model, seed=init_seed).state_dict()
    rows = []
    for index, client in enumerate(clients):
        local = build_model(model)
        local.load_state_dict(start)
        seed = None if noise_seed is None else noise_seed + 2 * index
        result = train_dp(local, client.x_train, client.y_train, config, round_number=1,
                          seed=seed)
        rows.append(flatten_update(result.update))
        if on_client_done is not None:
            on_client_done(index)
    return np.stack(rows)
