#!/usr/bin/env bash
# A Python base image built from the Debian archive alone, for sites that reach no image
# registry (docker/Dockerfile's BASE_IMAGE):
#   docker/base-image.sh [TAG [CACHE_DIR]]        # default dpcfl-base:bookworm, /var/cache/dpcfl-docker
# debootstraps a minimal bookworm with python3 and venv (as root), keeps its tarball in
# CACHE_DIR for the next time, and imports it into the engine DOCKER_HOST names.
set -euo pipefail
tag=${1:-dpcfl-base:bookworm}
cache=${2:-${DPCFL_DOCKER_CACHE:-/var/cache/dpcfl-docker}}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tarball="$cache/base-bookworm.tar"

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag is in the engine already"
  exit 0
fi
mkdir -p "$cache"
if [ ! -s "$tarball" ]; then
  rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap bookworm from $mirror into $rootfs (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -5 "$cache/debootstrap.log"; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
fi
docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' "$tarball" "$tag" >/dev/null
echo "base image $tag imported from $tarball"
