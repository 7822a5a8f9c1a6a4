"""A deployed silo's own schema: the only one its records are ever read under.

The federation's schema (input shape, classes and their names, a table's features, label
column and missing-values rule, image normalisation) also travels in the run config, which the
server writes. Were a silo to build its records to that copy, a server could send schemas that
differ in one detail (a category left out, a class folder not named, ``num-classes`` one
lower) and learn from accept / refuse whether some record holds that detail, for free and as
often as it likes. So a deployed silo pins its schema (``schema-file`` in its silo file; a
benchmark silo's is its dataset's default), checks its records against it when it starts, and
refuses any run whose schema differs from the pinned one *before any record is read*, with a
reason that depends on the two schemas alone
(docs/threat-model.md#what-a-message-can-learn-about-a-silos-records). In simulation one
operator writes both, so the run config's schema is used.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..config.config_file import load_schema
from ..config.settings import ConfigError, SiloConfig, parse_run_config
from ..data.schema import Schema
from ..data.sources import SCHEMA_FREE_SOURCES
from .requests import BadRequest

#: Each field of :class:`~..data.schema.Schema` and the run-config key that sets it.
SCHEMA_KEYS = {"input_shape": "input-shape", "num_classes": "num-classes",
               "class_names": "class-names", "features": "features", "label": "label-column",
               "missing": "missing-values", "image_mean": "image-mean",
               "image_std": "image-std", "input_scaling": "input-scaling"}


class SchemaMismatch(BadRequest):
    """A run whose schema is not the silo's pinned one: refused before any record is read."""


def pinned_schema(settings: SiloConfig) -> Schema:
    """The schema a deployed silo with these resolved settings reads its records under: its
    ``schema-file``'s, else (benchmark records, read as stored) the default schema of its
    dataset. ConfigError (local to the silo: it names the file) when the file cannot be read,
    or when a silo's own records come without one."""
    if settings.schema_file:
        return _schema_of_file(str(Path(settings.schema_file)))
    if settings.data_source == "benchmark":
        return _benchmark_schema(settings.dataset or "fmnist")
    needs = "its records" if settings.data_source in SCHEMA_FREE_SOURCES \
        else "the records it builds"
    raise ConfigError(f"node config: a deployed silo with data-source = "
                      f"{settings.data_source} pins the federation's schema for {needs}: "
                      "set schema-file (docs/own-data.md#the-federations-schema)")


@functools.lru_cache(maxsize=8)
def _schema_of_file(path: str) -> Schema:
    # read once per process: the pinned schema is fixed for the silo's lifetime
    return load_schema(path)


@functools.lru_cache(maxsize=4)
def _benchmark_schema(dataset: str) -> Schema:
    return parse_run_config({"dataset": dataset}).data_schema


def refuse_other_schema(pinned: Schema, proposed: Schema) -> None:
    """SchemaMismatch naming the run-config keys where ``proposed`` differs from ``pinned``;
    a function of the two schemas only, never of the records."""
    differing = [key for field, key in SCHEMA_KEYS.items()
                 if getattr(pinned, field) != getattr(proposed, field)]
    if differing:
        one = len(differing) == 1
        raise SchemaMismatch(
            f"run config: schema key{'' if one else 's'} {', '.join(differing)} "
            f"differ{'s' if one else ''} from this silo's pinned schema; a deployed silo "
            "reads its records under its own schema-file only")
