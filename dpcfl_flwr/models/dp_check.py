"""Whether DP-SGD can train a model as built: Opacus' validator decides, and may fix it.

DP-SGD clips each record's gradient, which presumes that a record's gradient depends on that
record alone. A layer that mixes the records of a batch (BatchNorm, and the layers Opacus
registers validators for) breaks that: one record then moves every other record's gradient,
and clipping no longer bounds its influence. Such a model is refused with one line naming its
offending layers, or, when the run config says ``model-fix = true``, converted by Opacus'
``ModuleValidator.fix`` (BatchNorm becomes GroupNorm) and the conversion logged. Server and
silos run the same conversion on the same architecture, so they agree on the tensors.

The check runs before any layer is frozen, so a frozen BatchNorm is refused too: frozen, it
still normalises each record with its batch's statistics and updates its running buffers.
"""

from __future__ import annotations

import logging

from torch import nn

from ..config.validation import ConfigError

logger = logging.getLogger(__name__)

#: The conversions this process has logged at INFO.
_LOGGED: set[str] = set()

#: Layers no Opacus validator looks at: a model made only of these (and parameter-free
#: modules), with no buffers, skips importing Opacus (seconds, in every ClientApp process).
_PLAIN = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.GroupNorm, nn.LayerNorm, nn.Embedding)


def needs_opacus_check(model: nn.Module) -> bool:
    """False when Opacus' validator would find nothing to refuse: no buffers (running
    statistics) and every module holding parameters of a type in :data:`_PLAIN`."""
    if any(True for _ in model.buffers()):
        return True
    return any(type(module) not in _PLAIN for module in model.modules()
               if any(True for _ in module.parameters(recurse=False)))


def offending_layers(model: nn.Module) -> list[str]:
    """``name (Type)`` of every module an Opacus validator refuses, in module order."""
    from opacus.validators import ModuleValidator

    named = []
    for name, module in model.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(module))
        if check is not None and check(module):
            named.append(f"{name or '<root>'} ({type(module).__name__})")
    return named


def dp_trainable(model: nn.Module, name: str, fix: bool) -> nn.Module:
    """``model`` if Opacus' ``ModuleValidator.validate`` accepts it; with ``fix``, the
    converted copy ``ModuleValidator.fix`` makes (logged); else ConfigError naming the
    layers."""
    model.train()  # Opacus validates a model in training mode, as DP-SGD runs it
    if not needs_opacus_check(model):
        return model
    from opacus.validators import ModuleValidator

    if not ModuleValidator.validate(model, strict=False):
        return model
    layers = offending_layers(model) or ["the model as a whole"]
    if not fix:
        raise ConfigError(f"model {name!r} cannot be trained with DP-SGD: Opacus refuses "
                          f"{', '.join(layers)}; set model-fix = true to let Opacus replace "
                          "them (BatchNorm becomes GroupNorm)")
    try:
        fixed = ModuleValidator.fix(model)
    except Exception as exc:  # Opacus' fixers raise what their layer's code raises
        first = (str(exc).strip().splitlines() or ["(no message)"])[0]
        raise ConfigError(f"model {name!r}: model-fix failed on {', '.join(layers)} "
                          f"({type(exc).__name__}: {first})") from None
    fixed.train()
    remaining = ModuleValidator.validate(fixed, strict=False)
    if remaining:
        left = offending_layers(fixed) or [type(remaining[0]).__name__]
        raise ConfigError(f"model {name!r} cannot be trained with DP-SGD even after "
                          f"model-fix: Opacus still refuses {', '.join(left)}")
    message = f"model {name}: Opacus replaced {', '.join(layers)} (model-fix = true)"
    # a silo builds the model for every candidate and round: say it once per process
    logger.log(logging.DEBUG if message in _LOGGED else logging.INFO, "%s", message)
    _LOGGED.add(message)
    return fixed
