"""Datasets of the experiments: file readers and the paper's cluster-structured split
(docs/experiments.md).

The split (:mod:`.partition`) builds torch tensors, so its names are imported on first use
(PEP 562): the silo supervisor (``dpcfl client``) and the deployment commands read a
:class:`Topology` or a :class:`DataError` from here and never train, and importing torch would
cost each of them some 300 MB of memory for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .readers import (
    DATASETS,
    FASHION_MNIST_DEBIAN_DIR,
    FASHION_MNIST_ENV_VAR,
    DataError,
    ImageSet,
    find_fashion_mnist,
    load_cifar10,
    load_dataset,
    load_idx_dataset,
    read_idx,
)
from .topology import Topology

if TYPE_CHECKING:
    from .partition import (
        DRAWS,
        SHIFTS,
        ClientData,
        ClientIndices,
        draw_indices,
        flip_labels,
        make_client_data,
        normalisation,
        rotate_images,
        rotation_degrees,
    )

#: The names :mod:`.partition` provides, imported (with torch) when first asked for.
_PARTITION_NAMES = frozenset({
    "DRAWS", "SHIFTS", "ClientData", "ClientIndices", "draw_indices", "flip_labels",
    "make_client_data", "normalisation", "rotate_images", "rotation_degrees",
})


def __getattr__(name: str) -> Any:
    if name in _PARTITION_NAMES:
        value = getattr(importlib.import_module(".partition", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATASETS", "DRAWS", "FASHION_MNIST_DEBIAN_DIR", "FASHION_MNIST_ENV_VAR", "SHIFTS",
    "ClientData", "ClientIndices", "DataError", "ImageSet", "Topology", "draw_indices",
    "find_fashion_mnist", "flip_labels", "load_cifar10", "load_dataset", "load_idx_dataset",
    "make_client_data", "normalisation", "read_idx", "rotate_images", "rotation_degrees",
]
