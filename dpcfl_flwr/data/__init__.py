"""Datasets of the experiments: file readers and the paper's cluster-structured split
(docs/experiments.md)."""

from .partition import (
    DRAWS,
    SHIFTS,
    ClientData,
    ClientIndices,
    Topology,
    draw_indices,
    flip_labels,
    make_client_data,
    normalisation,
    rotate_images,
    rotation_degrees,
)
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

__all__ = [
    "DATASETS", "DRAWS", "FASHION_MNIST_DEBIAN_DIR", "FASHION_MNIST_ENV_VAR", "SHIFTS",
    "ClientData", "ClientIndices", "DataError", "ImageSet", "Topology", "draw_indices",
    "find_fashion_mnist", "flip_labels", "load_cifar10", "load_dataset", "load_idx_dataset",
    "make_client_data", "normalisation", "read_idx", "rotate_images", "rotation_degrees",
]
