"""Training only some layers: the run config's ``trainable`` prefixes, the rest frozen.

With DP the common case is fine-tuning a pretrained model's head: the noise DP-SGD adds grows
with the number of trained coordinates, so training fewer of them on a good start gives more
accuracy for the same epsilon. Frozen parameters get ``requires_grad = False``; the per-sample
engines then clip over, and add noise to, the trainable ones only, and a frozen parameter's
coordinates of every update are exactly 0.

A prefix names a module or parameter by its dotted path and matches at dot boundaries:
``classifier`` matches ``classifier.weight`` and ``classifier.bias``, ``hidden.2`` matches
``hidden.2.weight`` but not ``hidden.21.weight``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.validation import ConfigError

if TYPE_CHECKING:  # config validation reads the prefixes without torch
    from torch import nn


def parse_prefixes(text: str) -> tuple[str, ...]:
    """``"hidden.2, classifier"`` as ``("hidden.2", "classifier")``; empty: every layer."""
    return tuple(part.strip().rstrip(".") for part in text.split(",") if part.strip())


def _matches(parameter: str, prefix: str) -> bool:
    return parameter == prefix or parameter.startswith(prefix + ".")


def freeze_except(model: nn.Module, prefixes: tuple[str, ...], name: str) -> None:
    """Freeze (in place) every parameter of ``model`` no prefix matches; no prefixes: train
    all. ConfigError naming a prefix that matches no parameter (a typo would otherwise freeze
    the whole model)."""
    if not prefixes:
        return
    names = [parameter for parameter, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(_matches(parameter, prefix) for parameter in names):
            modules = sorted({parameter.split(".")[0] for parameter in names})
            raise ConfigError(f"run config: trainable = {','.join(prefixes)!r}: {prefix!r} "
                              f"matches no parameter of model {name!r} (its top-level "
                              f"modules: {', '.join(modules)})")
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_(any(_matches(parameter_name, p) for p in prefixes))
