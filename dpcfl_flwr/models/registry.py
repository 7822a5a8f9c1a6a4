"""The model registry: every network a run can name, built-in or installed, and its parameters.

A model is a *builder*, a callable ``builder(num_classes, input_shape, params) -> nn.Module``:
``num_classes`` is the schema's C, ``input_shape`` one record's shape (no batch dimension, e.g.
``(1, 28, 28)`` or ``(14,)``) and ``params`` its validated parameters. The type annotation of
the third argument says what the parameters are: a pydantic model, validated from the run
config's ``model-params`` table. A builder ``(num_classes, input_shape)`` takes no parameters.

The built-ins (``cnn``, ``resnet18``, ``mlp``) are found the same way as installed plug-ins,
by a ``module:attribute`` reference, so both are loaded and checked by one code path. An
installed package adds a model with an entry point in the group :data:`ENTRY_POINT_GROUP`
(docs/own-data.md#models). A plug-in cannot take a built-in's name: a run's ``model = "cnn"``
means the paper's CNN on every silo, whatever else is installed there.

Every failure (a name not installed, a plug-in that does not import, bad parameters) is a
:class:`~dpcfl_flwr.config.validation.ConfigError` of one line.

A run's model as its config names it (:class:`ModelSpec`) is here too: this module does not
import torch (a builder's module does, when it is loaded), so the silo supervisor can validate
a config without it; :mod:`.spec` builds the module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from ..config.validation import ConfigError, ConfigModel, kebab, one_line_error

#: The entry point group through which installed packages add models.
ENTRY_POINT_GROUP = "dpcfl_flwr.models"

#: The run config's table of the chosen model's parameters (Flower flattens
#: ``[tool.flwr.app.config.model-params]`` to ``model-params.<key>``).
PARAMS_TABLE = "model-params"

#: The built-in models, by name: where their builders are.
BUILTINS = {
    "cnn": "dpcfl_flwr.models.paper:build_cnn",
    "resnet18": "dpcfl_flwr.models.paper:build_resnet18",
    "mlp": "dpcfl_flwr.models.mlp:build_mlp",
}


class NoParams(ConfigModel):
    """The parameters of a model that takes none (any key in its table is refused)."""


Builder = Callable[..., Any]


@dataclass(frozen=True)
class ModelEntry:
    """A loaded model: its name, builder, parameter type and where it comes from (for the
    error lines: ``built-in`` or ``entry point mlp2 = mypkg.models:build``)."""

    name: str
    builder: Builder
    params_type: type[BaseModel]
    origin: str
    takes_params: bool = True

    def __call__(self, num_classes: int, input_shape: tuple[int, ...], params: BaseModel
                 ) -> Any:
        """Call the builder (without ``params`` when it takes only two arguments)."""
        if self.takes_params:
            return self.builder(num_classes, input_shape, params)
        return self.builder(num_classes, input_shape)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the run config names it (hashable: silos cache its tensor layout).

    ``params``: the model's run-config table as sorted (key, value) pairs; ``input_shape``:
    one record's shape; ``trainable``: parameter-name prefixes to train (empty: all)."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()
    fix: bool = False
    trainable: tuple[str, ...] = ()


def _installed() -> dict[str, list[str]]:
    """Entry points of :data:`ENTRY_POINT_GROUP` by name: their ``module:attribute`` values
    (two installed packages may claim one name)."""
    found: dict[str, list[str]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, []).append(point.value)
    return found


def is_model(name: str) -> bool:
    """Whether a run config may name ``name`` here; installed packages are scanned only for a
    name that is not built in (a scan of every installed distribution takes tens of ms, and
    every message a silo answers validates the run config)."""
    return name in BUILTINS or name in _installed()


def model_names() -> tuple[str, ...]:
    """Every model a run config may name here: the built-ins, then installed plug-ins."""
    return (*BUILTINS, *sorted(name for name in _installed() if name not in BUILTINS))


def model_entry(name: str) -> ModelEntry:
    """The model called ``name``, its builder imported; ConfigError (one line) when it is not
    installed, claimed twice, or its plug-in fails to import."""
    if name in BUILTINS:
        return _load(name, BUILTINS[name], "built-in")
    claims = _installed().get(name, [])
    if not claims:
        raise ConfigError(f"unknown model {name!r}: not a built-in ({', '.join(BUILTINS)}) nor "
                          f"installed here through the entry point group {ENTRY_POINT_GROUP!r}")
    if len(set(claims)) > 1:
        raise ConfigError(f"model {name!r} is claimed by several installed entry points "
                          f"({', '.join(sorted(set(claims)))}); uninstall all but one")
    return _load(name, claims[0], f"entry point {name} = {claims[0]}")


@functools.lru_cache(maxsize=64)
def _load(name: str, reference: str, origin: str) -> ModelEntry:
    module_name, _, attribute = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split(".") if attribute else ():
            target = getattr(target, part)
    except Exception as exc:  # a plug-in's import may raise anything: one line, not a trace
        raise ConfigError(f"model {name!r} ({origin}) cannot be loaded: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    if not callable(target):
        raise ConfigError(f"model {name!r} ({origin}) is a {type(target).__name__}, not a "
                          "builder (num_classes, input_shape, params) -> nn.Module")
    try:
        arguments = list(inspect.signature(target, eval_str=True).parameters.values())
    except Exception as exc:  # an annotation that does not resolve, a C callable
        raise ConfigError(f"model {name!r} ({origin}): its builder's signature cannot be read: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    return ModelEntry(name, target, _params_type(arguments), origin, len(arguments) >= 3)


def _params_type(arguments: list[inspect.Parameter]) -> type[BaseModel]:
    """The pydantic model the builder's third argument is annotated with; NoParams when it
    has no third argument or no such annotation."""
    annotation = arguments[2].annotation if len(arguments) >= 3 else None
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return NoParams


def validate_params(entry: ModelEntry, table: Mapping[str, Any]) -> BaseModel:
    """The model's parameters from its run-config table (keys without the table's prefix);
    ConfigError naming an unknown key or a bad value. Keys are the parameter type's aliases,
    or its field names written with '-' for '_'."""
    fields = entry.params_type.model_fields
    keys = {(field.alias or kebab(name)): (field.alias or name) for name, field in fields.items()}
    keys.update({name: field.alias or name for name, field in fields.items()})
    unknown = sorted(set(table) - set(keys))
    if unknown:
        allowed = ", ".join(sorted(f"{PARAMS_TABLE}.{field.alias or kebab(name)}"
                                   for name, field in fields.items())) or "none"
        raise ConfigError(f"model {entry.name!r} has no parameter "
                          f"'{PARAMS_TABLE}.{unknown[0]}' (its parameters: {allowed})")
    try:
        return entry.params_type.model_validate({keys[key]: value for key, value in table.items()})
    except ValidationError as exc:
        raise one_line_error(exc, f"model {entry.name!r}", entry.params_type,
                             f"{PARAMS_TABLE}.") from None


def params_table(params: BaseModel) -> dict[str, Any]:
    """``params`` as its run-config table (the values that differ from the defaults: the run
    config every silo receives then names no key a model does not have)."""
    return params.model_dump(by_alias=True, exclude_defaults=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
