#!/usr/bin/env bash
# Start the SuperLink with TLS and node authentication, admitting the silos' public keys
# (every certs/nodes/*.pub; a key registered before, with the state kept in state/, stays as
# it is, so the same command restarts the SuperLink). Extra arguments go to `dpcfl server`
# and win over the ones here, e.g. --fleet-address 10.0.0.5:9092.
# Writes the `dpcfl` connection into $FLWR_HOME/config.toml for `flwr run . dpcfl`.
set -euo pipefail
cd "$(dirname "$0")/.."
keys=()
for key in certs/nodes/*.pub; do
    [[ -e "$key" ]] || { echo "error: no certs/nodes/*.pub: run server/make-certs.sh first" >&2; exit 2; }
    keys+=(--register "$key")
done
exec .venv/bin/dpcfl server --certs certs --fleet-address 0.0.0.0:9092 \
    --api-address 127.0.0.1:8000 --state state "${keys[@]}" "$@"
