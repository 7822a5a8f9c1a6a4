"""Validation at the edge: the strict model every config and request is, and its one-line errors.

Run configs, node configs, method tables and the silos' incoming requests are pydantic models
of this kind: kebab-case keys, unknown keys refused, frozen. A validation error becomes one
line for people that names the key and what was expected (:func:`one_line_error`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A run or node config that cannot be used; its message is one line for people."""


def kebab(name: str) -> str:
    """A field's config key: ``samples_per_client`` -> ``samples-per-client``."""
    return name.replace("_", "-")


class ConfigModel(BaseModel):
    """Kebab-case keys (field names also accepted), unknown keys refused, frozen."""

    model_config = ConfigDict(extra="forbid", alias_generator=kebab, populate_by_name=True,
                              frozen=True)


def one_line_error(error: ValidationError, what: str, model: type[BaseModel],
                   table: str = "") -> ConfigError:
    """One line for the first error of ``error``; ``table``: the method table it is from."""
    first = error.errors()[0]
    key = table + (".".join(str(part) for part in first["loc"]) or "?")
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(table + (field.alias or kebab(name))
                                   for name, field in model.model_fields.items()
                                   if not field.exclude))
        return ConfigError(f"{what}: unknown key '{key}' (allowed keys: {allowed or 'none'})")
    if first["type"] == "missing":
        return ConfigError(f"{what}: '{key}' is missing")
    value = first.get("input")
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a check of several keys together: its message names them
        return ConfigError(f"{what}: {message}")
    return ConfigError(f"{what}: '{key}' = {value!r} is invalid: {message}")
