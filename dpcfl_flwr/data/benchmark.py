"""The ``benchmark`` data source: a silo's slice of Fashion-MNIST, MNIST or CIFAR-10 with the
paper's shift (docs/experiments.md#datasets-and-shifts), behind the same interface as a silo's
own records. Its settings are the silo's node config keys ``dataset``, ``data-dir``,
``clusters``, ``shift``, ``samples-per-client``, ``test-samples`` and ``data-draw``."""

from __future__ import annotations

from .partition import ClientData, Topology, make_client_data
from .readers import load_dataset
from .sources import SourceRequest


def load_benchmark(request: SourceRequest) -> ClientData:
    """The silo's part of the benchmark dataset its options name (partition ``client_id``
    of the topology ``clusters``, drawn with ``seed``)."""
    options = request.options
    dataset = options["dataset"]
    train, test = load_dataset(dataset, options.get("data-dir") or None)
    return make_client_data(train, test, request.client_id, Topology.parse(options["clusters"]),
                            options["shift"], int(options["samples-per-client"]),
                            seed=request.seed, val_fraction=request.val_fraction,
                            test_samples=options.get("test-samples") or None, dataset=dataset,
                            draw=options["data-draw"])
