#!/usr/bin/env bash
# The GPU sweep on one NVIDIA H200 (MLX CUDA, bf16, dummy weights), within one device call.
#
# Expects MLX (mlx + mlx-cuda-13 + mlx-lm) and our pinned wheels installed under /tmp/site and
# PYTHONPATH=/tmp/site:$PWD (see docs/offline-gpu-install.md). For each
# preset: ours through gRPC, the raw mlx-lm forward loop and mlx_lm.server on the same weights,
# C = 1,4,8,16,32,64, 128-token completions. Results (JSON + PNG per preset, run.log) go to $OUT
# as they are made; a preset or peer that would start too late is skipped, so the call ends
# inside its limit with what it measured.
#
# Env: OUT (results dir), BUDGET_S (seconds this script may run, default 540), RUNS, CONC,
# MAX_TOKENS, PY (the python, default python3), CHECK (1: first check the CUDA decode attention
# kernel with bench/check_paged_attention.py and stop if it is wrong; default 1), SERVER_ARGS
# (extra flags for our server, one string), TAG (suffix of the result names) and CHANNELS (gRPC
# connections the harness opens, default 32: the kernel spreads connections over the front ends by
# a hash, and a few connections can leave a front end idle) and CLIENT_PROCS (client processes the
# harness sends from, default 4: one Python process cannot receive a GPU's tokens/s).
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-540}
# RUNS: preset:rounds:peers:seconds-needed, run in order while time is left.
RUNS=${RUNS:-"smollm2-135m:3:raw,mlx-lm:400 llama-3.2-1b:2:raw,mlx-lm:200 llama-3.1-8b:2:raw:150"}
CONC=${CONC:-1,4,8,16,32,64}
MAX_TOKENS=${MAX_TOKENS:-128}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
end=$((start + BUDGET_S))
mkdir -p "$OUT" /tmp/benchlogs
log="$OUT/run.log"
exec > >(tee -a "$log") 2>&1

source "$(dirname "$0")/gpu_env.sh"

nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv
"$PY" - <<'EOF' || { echo "MLX CUDA does not work here"; exit 4; }
import time, mlx.core as mx, grpc, google.protobuf, mlx_lm, transformers
print("mlx", mx.__version__, mx.default_device(), "grpc", grpc.__version__,
      "protobuf", google.protobuf.__version__, "mlx_lm", mlx_lm.__version__,
      "transformers", transformers.__version__)
if mx.default_device() == mx.gpu:
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16); mx.eval(a @ a)
    t = time.perf_counter(); [mx.eval(a @ a) for _ in range(10)]; dt = (time.perf_counter() - t) / 10
    print(f"bf16 8192^3 matmul: {2 * 8192**3 / dt / 1e12:.0f} TFLOP/s")
EOF

# The direct decode attention kernel against a naive attention, before any sweep relies on it.
if [ "${CHECK:-1}" = 1 ]; then
  timeout 90 "$PY" bench/check_paged_attention.py > "$OUT/check.txt" 2>&1
  rc=$?; cat "$OUT/check.txt"
  [ $rc -eq 0 ] || { echo "== paged attention kernel check failed (exit $rc): no sweep"; exit 6; }
fi

for spec in $RUNS; do
  IFS=: read -r preset rounds peers need <<<"$spec"
  now=$(date +%s); left=$((end - now))
  if [ "$left" -lt "$need" ]; then echo "== $preset: skipped, ${left}s left (needs ~${need}s)"; continue; fi
  peer_args=()
  [ -n "${SERVER_ARGS:-}" ] && peer_args+=("--server-args=$SERVER_ARGS")
  for p in ${peers//,/ }; do peer_args+=(--peer "$p"); done
  echo "== $preset: ${left}s left (rounds $rounds, peers ${peers:-none})"
  timeout --signal=TERM $((left - 5)) "$PY" -m bench.compare --spawn-server \
    --load-format "dummy:$preset" --dtype bfloat16 --concurrency "$CONC" \
    --max-tokens "$MAX_TOKENS" --rounds "$rounds" --min-requests 8 --warmup 2 --warmup-rounds 1 \
    --channels "${CHANNELS:-32}" --client-processes "${CLIENT_PROCS:-4}" \
    "${peer_args[@]}" --targets gpu --deadline $((end - 60)) \
    --export-dir /tmp/mlx-lm-export --log-dir /tmp/benchlogs \
    --title "dummy:$preset bf16, H200, $MAX_TOKENS-token completions, burst rounds of C" \
    --out "$OUT/$preset${TAG:-}.json"
  rc=$?
  echo "== $preset: exit $rc after $(( $(date +%s) - now ))s"
  if [ $rc -ne 0 ]; then
    for f in /tmp/benchlogs/$preset*.log; do echo "--- tail $f"; tail -25 "$f"; done
  fi
done
echo "== total $(( $(date +%s) - start ))s"
