"""The method registry: every federated method the app can run, by name.

A method is one module of :mod:`dpcfl_flwr.methods` whose class is decorated with
:func:`register` (docs/adding-a-method.md). Config validation, the strategy factory, ``dpcfl
compare`` and the docs all read this registry, so a method's name is written once, on its
class. The built-in methods are found by importing every module of the ``methods`` package
the first time the registry is read; a method defined elsewhere (a test, a user's package)
registers itself by being imported.

This module imports none of ours at load time: ``config`` reads it to validate a run config,
and the methods import ``config`` for their parameter tables.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .methods.base import Method

M = TypeVar("M", bound="type[Method]")

_METHODS: dict[str, type[Method]] = {}
_BUILTINS_LOADED = False


def register(cls: M) -> M:
    """Class decorator: make ``cls`` runnable as ``method = cls.name``.

    Raises ValueError when another class already holds that name (two modules claiming one
    name would make a run's method depend on import order)."""
    name = cls.name
    holder = _METHODS.get(name)
    if holder is not None and holder is not cls and (
            holder.__module__, holder.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"method name {name!r} is taken by {holder.__module__}."
                         f"{holder.__qualname__}")
    _METHODS[name] = cls
    return cls


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


def methods() -> dict[str, type[Method]]:
    """Every registered method by name, built-ins first in the order their modules load."""
    _load_builtins()
    return dict(_METHODS)


def method_names() -> tuple[str, ...]:
    return tuple(methods())


def method_class(name: str) -> type[Method]:
    """The method called ``name``; ValueError naming the available ones otherwise."""
    known = methods()
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"method {name!r} is not available; choose from "
                         f"{', '.join(sorted(known))}") from None
