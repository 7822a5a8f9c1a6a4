"""Joining a running Ray cluster for a simulation (``dpcfl simulate --ray-address``).

Flower's engine starts a local Ray unless Ray is already connected; here the driver connects
first, so that what can go wrong (no cluster at the address, another Ray version, no node that
fits one silo) is one line before any silo starts. Ray's own connection attempt to an address
where no cluster answers waits minutes (measured: 145 s, Ray 2.55) with C++ warnings on
stderr, so the address is tried with a plain TCP connection first.

What a worker node receives from the driver: the ClientApp object (its code by reference to
the installed ``dpcfl_flwr``, never the code itself), each silo's messages and its run config.
What it must already have: the same Python environment with the same ``dpcfl_flwr``, Flower
and Ray versions, and the silos' records and ledger directory at the paths the run config
names (docs/simulation.md#a-ray-cluster).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

#: How long the TCP probe of the cluster's address may take before it is called unreachable.
CONNECT_SECONDS = 5.0


class ClusterError(ValueError):
    """The Ray cluster at the given address cannot run the simulation (one line)."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` of a Ray cluster's head (its GCS, ``ray start --head --port``); the
    Ray Client form ``ray://`` is refused (the engine's actors need a driver on the cluster's
    own network)."""
    if address.startswith("ray://"):
        raise ClusterError(f"--ray-address {address}: give the head's GCS address host:port "
                           "(ray start --head --port, default 6379), not a Ray Client ray:// "
                           "address")
    host, colon, port = address.strip().rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"--ray-address {address!r}: expected host:port of the cluster's "
                           "head, e.g. 10.0.0.5:6379")
    return host.strip("[]"), int(port)


def probe(address: str, seconds: float = CONNECT_SECONDS) -> None:
    """Raise :class:`ClusterError` unless something accepts TCP connections at ``address``."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=seconds):
            pass
    except socket.gaierror as exc:
        raise ClusterError(f"--ray-address {address}: cannot resolve {host} "
                           f"({exc.strerror})") from None
    except TimeoutError:
        raise ClusterError(f"--ray-address {address}: no answer within {seconds:g} s; is the "
                           "head running (ray start --head) and the port open?") from None
    except OSError as exc:
        raise ClusterError(f"--ray-address {address}: no Ray cluster answers there "
                           f"({exc.strerror or exc}); start one with ray start --head") from None


def connect(address: str, *, verbose: bool) -> None:
    """Connect this process to the Ray cluster at ``address`` as the simulation's driver,
    its workers' PYTHONPATH set as Flower's own engine sets it for a local Ray."""
    import ray

    probe(address)
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    try:
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                 logging_level=logging.DEBUG if verbose else logging.ERROR,
                 log_to_driver=verbose)
    except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError, ConnectionError, ...
        ray.shutdown()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"--ray-address {address}: cannot join the Ray cluster "
                           f"({reason})") from None


def check_fits(silo_resources: dict[str, float]) -> dict[str, Any]:
    """The connected cluster's resources, once it is known that one node can host a silo
    (``{"num_cpus": c, "num_gpus": g}``); :class:`ClusterError` naming every node's
    resources otherwise (Flower's engine would wait for an actor that never starts)."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    need_cpus, need_gpus = silo_resources["num_cpus"], silo_resources.get("num_gpus", 0.0)
    if any(n.get("CPU", 0.0) >= need_cpus and n.get("GPU", 0.0) >= need_gpus for n in nodes):
        return ray.cluster_resources()
    seen = "; ".join(f"CPU {n.get('CPU', 0):g}, GPU {n.get('GPU', 0):g}" for n in nodes)
    raise ClusterError(f"no node of the Ray cluster can host one silo (silo-cpus = "
                       f"{need_cpus:g}, silo-gpus = {need_gpus:g}); its nodes have: "
                       f"{seen or 'none alive'}")


#: How long each node may take to start a worker and look for the shared directory.
NODE_CHECK_SECONDS = 120.0


def _holds(path: str, name: str) -> bool:
    return (Path(path) / name).is_file()


def check_shared(directory: Path) -> None:
    """Raise :class:`ClusterError` unless every node of the connected cluster sees the file
    this driver writes in ``directory`` at the same path. A silo's messages go to whichever
    node has a free actor, so its ledger (and the models it keeps beside it) must be one file
    that every node reads and writes: a node with a ledger of its own would let the silo
    spend its budget once on each node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / f".node-check-{uuid.uuid4().hex}"
    marker.write_text("written by the simulation's driver\n")
    try:
        nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
        look = ray.remote(num_cpus=0)(_holds)
        checks = {node: look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(str(directory), marker.name) for node in nodes}
        try:
            seen = dict(zip(checks, ray.get(list(checks.values()), timeout=NODE_CHECK_SECONDS),
                            strict=True))
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the cluster's nodes did not all answer within "
                               f"{NODE_CHECK_SECONDS:g} s whether they see {directory}") from None
    finally:
        marker.unlink(missing_ok=True)
    blind = [node for node, sees in seen.items() if not sees]
    if blind:
        raise ClusterError(
            f"{len(blind)} of {len(nodes)} nodes of the Ray cluster do not see {directory} "
            f"(node {blind[0][:12]}...): the silos' ledgers must live on a filesystem every "
            "node shares at the same path (set ledger-dir or out-dir there)")


__all__ = ["ClusterError", "check_fits", "check_shared", "connect", "probe", "split_address"]
