"""A pretrained start: theta_init read from a file on the server, checked against the model.

Only the server reads it (run config ``initial-weights``, a path relative to the directory the
server runs in; ``dpcfl simulate`` makes it absolute first). The file holds the model's state
as built, after any ``model-fix``: a ``.pt`` state dict (``torch.save(model.state_dict())``,
read with ``weights_only``, so it runs no code) or an ``.npz`` of the same names. Every tensor
must be there with the model's shape, nothing else, every value finite: a mismatch is one line.
Silos need no check of their own: they accept any weights the server sends and bound every
per-record quantity whatever the weights are (docs/threat-model.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.validation import ConfigError


def _read(path: Path) -> Mapping[str, Any]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as arrays:
            return {name: arrays[name] for name in arrays.files}
    if path.suffix in (".pt", ".pth"):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"holds a {type(loaded).__name__}, not a state dict")
        return loaded
    raise ValueError("expected a .pt / .pth state dict or an .npz file")


def load_initial_weights(path: str | Path, state: Mapping[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
    """The file's tensors in ``state``'s order and dtypes; ConfigError (one line naming the
    file) when it cannot be read or differs from ``state`` in names, shapes or finiteness."""
    where = f"run config: initial-weights {str(path)!r}"
    try:
        stored = _read(Path(path))
    except Exception as exc:  # unpickling and zip errors of a damaged file are of many kinds
        lines = str(exc).strip().splitlines()
        raise ConfigError(f"{where}: cannot be read: {type(exc).__name__}: "
                          f"{lines[0] if lines else '(no message)'}") from None
    missing = [name for name in state if name not in stored]
    unexpected = [name for name in stored if name not in state]
    if missing or unexpected:
        raise ConfigError(f"{where}: its tensors are not the model's (missing "
                          f"{missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'})")
    weights = {}
    for name, like in state.items():
        value = torch.as_tensor(np.asarray(stored[name]) if not isinstance(
            stored[name], torch.Tensor) else stored[name])
        if tuple(value.shape) != tuple(like.shape):
            raise ConfigError(f"{where}: tensor {name!r} has shape {tuple(value.shape)}, the "
                              f"model's is {tuple(like.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ConfigError(f"{where}: tensor {name!r} has non-finite values")
        weights[name] = value.detach().to(like.dtype).clone()
    return weights
