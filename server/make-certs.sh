#!/usr/bin/env bash
# Make the deployment's TLS material: a CA, the SuperLink certificate for the names/addresses the
# silos dial, and one node key pair per silo of the default topology {3,6,6,6}.
#   server/make-certs.sh superlink.example.org 203.0.113.7
# Give certs/ca.crt and certs/nodes/silo-NN (+ .pub) to silo NN; keep certs/ca.key offline.
set -euo pipefail
cd "$(dirname "$0")/.."
sans=()
for name in "${@:-localhost}"; do sans+=(--san "$name"); done
exec .venv/bin/dpcfl certs --out certs "${sans[@]}" --san 127.0.0.1 --nodes 21
