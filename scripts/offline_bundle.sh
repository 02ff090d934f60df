#!/usr/bin/env bash
# A wheel bundle for installing mlxserve's CUDA build on a GPU host without network access
# (docs/offline-gpu-install.md). Run on a connected machine from the checkout:
#
#   bash scripts/offline_bundle.sh [DIR] [--split MB]
#
# DIR (default .bundle) gets every wheel the server needs on Linux x86-64 with CPython 3.12 (MLX
# with its CUDA 13 backend, mlx-lm, the pinned runtime dependencies of pyproject.toml, and py-spy
# for profiling, and pytest with the plugins and libraries the suite imports (the test helpers
# make TLS certificates with cryptography), for the CUDA tests). With --split MB, wheels larger
# than MB are cut into MB-sized parts (NAME.part.aa, .ab, ...) for transfers with a size limit;
# `cat NAME.part.* > NAME` rejoins one.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.bundle
split_mb=""
while [ $# -gt 0 ]; do
  case "$1" in
    --split) split_mb=$2; shift 2 ;;
    *) dir=$1; shift ;;
  esac
done
mkdir -p "$dir"
# The runtime dependencies exactly as pyproject.toml pins them (the client package aside: it is
# this checkout).
deps=$(python3 - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
pins = [d for d in project["dependencies"] if not d.startswith("mlxserve-client")]
pins += project["optional-dependencies"]["cuda"]
print(" ".join(p.replace("mlx[cuda13]", "mlx-cuda-13") for p in pins))
PY
)
platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# shellcheck disable=SC2086  # one word per requirement
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" $deps py-spy pytest pytest-asyncio pytest-timeout hypothesis \
  "cryptography>=44" jsonschema==4.26.0
if [ -n "$split_mb" ]; then
  for whl in "$dir"/*.whl; do
    if [ "$(stat -c %s "$whl")" -gt $((split_mb * 1024 * 1024)) ]; then
      split -b "${split_mb}M" "$whl" "$whl.part." && rm "$whl"
    fi
  done
fi
du -sh "$dir"
