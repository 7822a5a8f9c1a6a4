"""Where a silo's records come from: one interface for every data source (docs/own-data.md).

A data source is a function ``load(request: SourceRequest) -> ClientData``: it reads the
silo's records, builds them to the federation's schema and returns the silo's train /
validation / test split (given by the records, or drawn with :func:`draw_split` and the
silo's seed). Built in: ``benchmark`` (a slice of Fashion-MNIST, MNIST or CIFAR-10 with the
paper's shift), ``arrays``, ``image-folder`` and ``table``. An installed package adds one
through the entry point group :data:`ENTRY_POINT_GROUP`; like every other piece of code a silo
runs, it is the silo's own installed code, never something the server sends.

Every problem is one line (:class:`~.readers.DataError`) naming the file and what was
expected, and no statistic of the records (no counts, values or label histogram): a refusal's
reason reaches the server. A plug-in that raises anything else is reported the same way.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .readers import DataError
from .schema import Schema

if TYPE_CHECKING:  # its tensors need torch, which the silo supervisor never imports
    from .partition import ClientData

#: Entry point group of installed data sources: ``name = "package.module:load"``.
ENTRY_POINT_GROUP = "dpcfl_flwr.data_sources"

#: The built-in sources, by name, as ``module:function`` of this package (imported on use,
#: so a silo reading arrays does not import an image or table library).
BUILT_IN = {
    "benchmark": "dpcfl_flwr.data.benchmark:load_benchmark",
    "arrays": "dpcfl_flwr.data.arrays:load_arrays_source",
    "image-folder": "dpcfl_flwr.data.image_folder:load_image_folder",
    "table": "dpcfl_flwr.data.table:load_table",
}

#: The built-in sources that read records as stored, without the federation's schema (the
#: schema is checked after): a silo can read them before a run tells it the schema.
SCHEMA_FREE_SOURCES = ("benchmark", "arrays")

#: The splits a source returns; validation may be empty.
SPLITS = ("train", "val", "test")

#: A silo's ``records-memory`` unless it sets one (MiB): records whose float32 tensors fit in
#: it are read into memory when the silo starts, larger ones are read when used.
RECORDS_MEMORY_MIB = 1024


@dataclass(frozen=True)
class SourceRequest:
    """What a source is asked for.

    - ``path``: the silo's ``data-path`` (resolved; a source that needs no file gets ``.``);
    - ``client_id``: the silo's partition id (its name in logs and errors);
    - ``seed``: the silo's ``data-seed``, for a split drawn on the silo;
    - ``val_fraction``, ``test_fraction``: of a drawn split, ``test_fraction`` of the records
      for test and ``val_fraction`` of the rest for validation;
    - ``schema``: the federation's schema the records are built to;
    - ``options``: the silo's resolved node config (kebab-case keys), for a source with
      settings of its own (the benchmark's dataset and shift, a table's split column).
    """

    path: Path
    client_id: int
    seed: int
    val_fraction: float
    test_fraction: float
    schema: Schema
    options: Mapping[str, Any] = field(default_factory=dict)


Loader = Callable[[SourceRequest], "ClientData"]


def _installed() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def source_names() -> tuple[str, ...]:
    """Every source a silo can name: the built-ins, then installed plug-ins."""
    return tuple(BUILT_IN) + tuple(sorted(set(_installed()) - set(BUILT_IN)))


def is_source(name: str) -> bool:
    """Whether a silo can name ``name`` (a built-in answers without scanning the installed
    packages' entry points, which takes tens of milliseconds)."""
    return name in BUILT_IN or name in _installed()


@functools.cache
def _import(target: str) -> Loader:
    module, _, name = target.partition(":")
    loader: Loader = getattr(importlib.import_module(module), name)
    return loader


def loader_named(name: str) -> Loader:
    """The load function of source ``name``; DataError if no such source is installed (or
    its plug-in cannot be imported)."""
    if name in BUILT_IN:
        return _import(BUILT_IN[name])
    installed = _installed()
    if name not in installed:
        raise DataError(f"data-source {name!r} is not installed on this silo; installed: "
                        f"{', '.join(source_names())}")
    try:
        loader = installed[name].load()
    except Exception as exc:  # a plug-in's own failure, reported as one line
        raise DataError(f"data-source {name!r} ({installed[name].value}) cannot be loaded: "
                        f"{type(exc).__name__}: {exc}") from None
    if not callable(loader):
        raise DataError(f"data-source {name!r} ({installed[name].value}) is not a function")
    return loader  # type: ignore[no-any-return]


def load_records(name: str, request: SourceRequest) -> ClientData:
    """The silo's records from source ``name``, checked for shape and content (not yet the
    schema: :func:`~.arrays.check_schema`). Anything a plug-in raises becomes one line."""
    from .partition import ClientData  # noqa: PLC0415 (torch: only when records are read)

    loader = loader_named(name)
    try:
        data = loader(request)
    except DataError:
        raise
    except Exception as exc:
        if name in BUILT_IN:
            raise
        raise DataError(f"data-source {name!r} failed on {request.path}: "
                        f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, ClientData):
        raise DataError(f"data-source {name!r} returned {type(data).__name__}, not ClientData")
    return data


def draw_split(n: int, seed: int, val_fraction: float, test_fraction: float
               ) -> dict[str, np.ndarray]:
    """Rows 0..n-1 split at random with ``seed``: ``test_fraction`` of them for test,
    ``val_fraction`` of the rest for validation, the rest for training (each split's rows
    in increasing order, so a lazily read source reads forward)."""
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(test_fraction * n))
    n_val = int(round(val_fraction * (n - n_test)))
    parts = {"test": order[:n_test], "val": order[n_test:n_test + n_val],
             "train": order[n_test + n_val:]}
    return {split: np.sort(rows) for split, rows in parts.items()}


def check_training_records(data: ClientData, where: str | Path) -> ClientData:
    """Refuse a silo with fewer than 2 training records (DP-SGD needs records to sample);
    the same rule for every source."""
    if data.num_train < 2:
        raise DataError(f"{where}: {data.num_train} training records; a silo needs at least 2")
    return data
