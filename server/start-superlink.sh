#!/usr/bin/env bash
# Start the SuperLink with TLS and node authentication, admitting the 21 silos' public keys.
# Writes the `dpcfl` connection into $FLWR_HOME/config.toml for `flwr run . dpcfl`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/dpcfl server --certs certs --fleet-address 0.0.0.0:9092 \
    --api-address 127.0.0.1:8000 --state state --register certs/nodes/silo-*.pub "$@"
