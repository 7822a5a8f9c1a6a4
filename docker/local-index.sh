#!/usr/bin/env bash
# A package index on this machine for docker/Dockerfile (PIP_INDEX_URL, TORCH_INDEX), for sites
# whose builds reach neither PyPI nor the PyTorch index:
#   docker/local-index.sh DIR      # DIR/wheels: every wheel the image installs; DIR/simple: the index
#   python3 -m http.server 8090 --bind 127.0.0.1 --directory DIR
#   docker build --network host --build-arg PIP_INDEX_URL=http://127.0.0.1:8090/simple/ \
#       --build-arg TORCH_INDEX=http://127.0.0.1:8090/simple/ ...
# The wheels come from this machine's pip as it is configured (its own index, find-links and
# the CPU torch wheel it is given); run it again to add what a changed pyproject.toml needs.
set -euo pipefail
out=${1:?usage: docker/local-index.sh DIR}
cd "$(dirname "$0")/.."
mkdir -p "$out/wheels"
python3 -m pip download -q -d "$out/wheels" "torch==2.13.0" . hatchling 2>&1 \
  | grep -v "^WARNING: Location" || true
# PEP 503: one directory per normalised project name, linking its files
rm -rf "$out/simple"
for file in "$out"/wheels/*; do
  base=$(basename "$file")
  name=$(printf '%s' "$base" | sed -E 's/-[0-9].*$//' | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g')
  mkdir -p "$out/simple/$name"
  ln -sf "../../wheels/$base" "$out/simple/$name/$base"
done
echo "local index: $(ls "$out/simple" | wc -l) projects in $out/simple"
