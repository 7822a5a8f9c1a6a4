"""The method registry: every federated method the app can run, by name.

A method is one module of :mod:`dpcfl_flwr.methods` whose class is decorated with
:func:`register` (docs/adding-a-method.md). Config validation, the strategy factory, ``dpcfl
compare`` and the docs all read this registry, so a method's name is written once, on its
class. The built-in methods are found by importing every module of the ``methods`` package
the first time the registry is read; a method defined elsewhere (a test, a user's package)
registers itself by being imported.

This module imports none of ours: ``config`` reads it to validate a run config, and the
methods, which read ``config``, register here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Protocol, TypeVar, cast

from pydantic import BaseModel


class MethodClass(Protocol):
    """What the registry and its readers use of a method's class
    (:class:`dpcfl_flwr.methods.base.Method`): its name and parameter table, its flags and
    privatiser, the simulation defaults it gives silos (``silo_defaults``), the fewest silos it
    runs with (``fewest_silos``) and the constructor ``(experiment, params, state)``."""

    name: str
    title: str
    Params: type[BaseModel]
    personal: bool
    discovers_clusters: bool
    weighs_updates: bool
    privatiser: str

    def __call__(self, experiment: Any, params: Any, state: Any) -> Any: ...

    def silo_defaults(self, params: Any) -> dict[str, Any]: ...

    def fewest_silos(self, params: Any) -> int: ...


T = TypeVar("T", bound=type)

_METHODS: dict[str, MethodClass] = {}
_BUILTINS_LOADED = False


def register(cls: T) -> T:
    """Class decorator: make ``cls`` runnable as ``method = cls.name``.

    Raises ValueError when another class already holds that name (two modules claiming one
    name would make a run's method depend on import order)."""
    name = cast(MethodClass, cls).name
    holder = _METHODS.get(name)
    if holder is not None and _origin(holder) != _origin(cls):
        raise ValueError(f"method name {name!r} is taken by {_origin(holder)}")
    _METHODS[name] = cast(MethodClass, cls)
    return cls


def _origin(cls: Any) -> str:
    """Where a class is defined: the same class imported twice registers once."""
    return f"{cls.__module__}.{cls.__qualname__}"


def unregister(name: str) -> None:
    """Forget method ``name`` (tests that register a toy method clean up with this)."""
    _METHODS.pop(name, None)


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    package = importlib.import_module("dpcfl_flwr.methods")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"dpcfl_flwr.methods.{module.name}")


def methods() -> dict[str, MethodClass]:
    """Every registered method by name, built-ins first in the order their modules load."""
    _load_builtins()
    return dict(_METHODS)


def method_names() -> tuple[str, ...]:
    return tuple(methods())


def method_class(name: str) -> MethodClass:
    """The method called ``name``; ValueError naming the available ones otherwise."""
    known = methods()
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"method {name!r} is not available; choose from "
                         f"{', '.join(sorted(known))}") from None
