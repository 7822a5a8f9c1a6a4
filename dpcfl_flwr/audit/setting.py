"""What an audit trains: a silo's records and model, real or synthetic."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..data import load_dataset, normalisation
from ..models import build_model

SYNTHETIC = "synthetic"
# The synthetic silo: 10 Gaussian classes in 64 dimensions and a 64-128-10 MLP (9,610
# parameters): a second of CPU per hundred steps, enough coordinates for thousands of canaries.
_FEATURES, _HIDDEN, _CLASSES = 64, 128, 10


def synthetic_silo(records: int, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``records`` points of 10 Gaussian classes (unit noise around means of norm ~3) and a
    fresh MLP, both drawn from ``seed``."""
    if records < 1:
        raise ValueError(f"records must be >= 1, got {records}")
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 3.0 / np.sqrt(_FEATURES), size=(_CLASSES, _FEATURES))
    labels = rng.integers(0, _CLASSES, size=records)
    points = means[labels] + rng.normal(size=(records, _FEATURES))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(_FEATURES, _HIDDEN), nn.ReLU(),
                              nn.Linear(_HIDDEN, _CLASSES))
    return (model, torch.from_numpy(points).float(), torch.from_numpy(labels))


def image_silo(dataset: str, records: int, model_name: str, seed: int,
               data_dir: str | None = None) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``records`` training records of ``dataset`` drawn without replacement from ``seed``,
    normalised as in training (docs/experiments.md#datasets-and-shifts), and a fresh
    ``model_name`` model."""
    train, _ = load_dataset(dataset, data_dir)
    if not 1 <= records <= len(train):
        raise ValueError(f"--records {records}: {dataset} has {len(train)} training records")
    rows = np.sort(np.random.default_rng(seed).choice(len(train), size=records, replace=False))
    mean, std = normalisation(dataset)
    pixels = torch.from_numpy(train.images[rows].astype(np.float32)) / 255.0
    x = (pixels - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    model = build_model(model_name, num_classes=train.num_classes,
                        in_channels=train.images.shape[1], seed=seed)
    return model, x.contiguous(), torch.from_numpy(train.labels[rows])
