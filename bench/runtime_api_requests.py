"""CPU per SuperLink Runtime API request: Flower's middleware stack against the launcher's.

A ServerApp of a 21-silo round makes ~200 Runtime API requests (mostly one per object it
pulls), and Flower 1.39 runs each through all six middlewares of its SuperLink app, four of
which act on Control API paths only (dpcfl_flwr/flower_compat/control_middleware.py). This builds
Flower's real app twice in one process, as Flower builds it and with those four kept to
Control paths, and sends each the same non-Control request (``GET /health``, which passes the
same stack as a Runtime API request) through Starlette's in-process test client, alternating
between the two; the figure includes the test client's own per-request work, so the ratio
understates the server-side saving.

  python bench/runtime_api_requests.py [--requests 2000] [--repeats 5] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import publish  # noqa: E402


def cpu_per_request(client, requests: int) -> float:
    """Milliseconds of this process's CPU per request."""
    started = time.process_time()
    for _ in range(requests):
        client.get("/health")
    return 1e3 * (time.process_time() - started) / requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    from dpcfl_flwr.flower_compat import control_middleware
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    flowers = control_middleware.superlink_app()
    if not control_middleware.install():
        raise SystemExit("not the Flower version the launcher patches")
    ours = control_middleware.superlink_app()
    best = {"flower": float("inf"), "launcher": float("inf")}
    with TestClient(flowers) as flower_client, TestClient(ours) as our_client:
        for client in (flower_client, our_client):  # warm up both
            cpu_per_request(client, 200)
        for _ in range(args.repeats):
            best["flower"] = min(best["flower"], cpu_per_request(flower_client, args.requests))
            best["launcher"] = min(best["launcher"],
                                   cpu_per_request(our_client, args.requests))
    body = ("| SuperLink app | CPU per request (ms, best of "
            f"{args.repeats} x {args.requests}) |\n|---|---|\n"
            f"| Flower's six middlewares | {best['flower']:.3f} |\n"
            f"| Control middlewares kept to Control paths | {best['launcher']:.3f} |\n\n"
            f"- launcher / Flower: {best['launcher'] / best['flower']:.2f}; saved "
            f"{best['flower'] - best['launcher']:.3f} ms per request (server and in-process "
            "test client together)")
    publish("Runtime API request cost (SuperLink middleware)", body,
            append=not args.no_append)


if __name__ == "__main__":
    main()
