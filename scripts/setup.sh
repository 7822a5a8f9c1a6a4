#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: the Fashion-MNIST package, a venv, torch, the app.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || missing+=(dataset-fashion-mnist)
# docker-compose validates compose.yaml in the tests (no Docker engine is needed for that).
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
# tests/test_compose_engine.py starts a Docker engine of its own and builds a base with debootstrap.
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# torch first and pinned: any other version (or an unpinned resolve) pulls gigabytes of CUDA.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, flwr, opacus; print('setup: torch', torch.__version__, \
'| flwr', flwr.__version__, '| opacus', opacus.__version__)"
