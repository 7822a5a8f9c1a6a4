"""A run config as a TOML file: reading one with ``key=value`` overrides, and writing values.

``dpcfl simulate``, ``dpcfl compare``, ``dpcfl submit`` and the silo-file writer read run
configs the same way: defaults, then a file of run-config keys (a bare table, or a
pyproject-style ``[tool.flwr.app.config]``), then overrides; a method's table ``[rdpcfl]``
becomes ``rdpcfl.<key>`` as Flower flattens it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..data.schema import Schema
from .settings import ExperimentConfig, parse_run_config
from .validation import ConfigError


def load_config(path: str | Path | None, overrides: Mapping[str, Any]) -> ExperimentConfig:
    """Defaults, then a TOML file of run-config keys, then ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
        # Accept both a bare table of keys and a pyproject-style [tool.flwr.app.config].
        raw.update(flat_keys(data.get("tool", {}).get("flwr", {}).get("app", {})
                             .get("config", data)))
    raw.update(overrides)
    return parse_run_config(raw)


def flat_keys(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A TOML table as run-config keys, the way Flower flattens its run config: a method's
    table ``[rdpcfl]`` with ``n-clusters = 4`` becomes ``rdpcfl.n-clusters = 4``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat.update(flat_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with a TOML value (``epsilon=5``, ``dataset="mnist"``, or bare words)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected key=value, got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return key.strip(), parsed


def toml_value(value: Any) -> str:
    """``value`` (a run-config value: bool, str or number) written as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


#: The run-config keys of the federation's data schema (docs/own-data.md).
SCHEMA_KEYS = ("input-shape", "num-classes", "class-names", "features", "label-column",
               "missing-values", "image-mean", "image-std", "input-scaling")


def load_schema(path: str | Path) -> Schema:
    """The federation's schema from a TOML file of schema keys (:data:`SCHEMA_KEYS`; a whole
    run config is accepted and its other keys ignored): what a silo expects before a run
    tells it, or what ``dpcfl data check --schema`` checks against. ConfigError in one line."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the schema file ({exc})") from None
    keys = flat_keys(data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", data))
    schema = {key: value for key, value in keys.items() if key in SCHEMA_KEYS}
    if not schema:
        raise ConfigError(f"{path}: no schema keys ({', '.join(SCHEMA_KEYS)})")
    try:
        return parse_run_config(schema).data_schema
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
