#!/usr/bin/env bash
# Where the serving stack's time goes on a GPU host: our server at C = 64 and 256 on a preset's
# random weights (bench/serving_overhead.py: tokens/s, CPU per token of the engine core and the
# front ends), with py-spy sampling both processes and nvidia-smi the GPU's utilization during
# each window; then the raw mlx-lm loop at the same batch sizes (bench/raw_loop.py).
#
# Expects MLX and our wheels under /tmp/site, py-spy on PATH (docs/offline-gpu-install.md). Env: OUT,
# PRESET (smollm2-135m), CONC ("64 256"), WINDOW (seconds, 20), SERVER_ARGS, CORE_SPY_ARGS (extra
# py-spy flags for the engine core, e.g. --native to see MLX's C++ frames).
set -uo pipefail
OUT=${OUT:-/tmp/out}; PRESET=${PRESET:-smollm2-135m}; CONC=${CONC:-"64 256"}; WINDOW=${WINDOW:-20}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
core_pid() {  # the launcher's child that maps libmlx
  for p in $(pgrep -P "$1"); do grep -q libmlx "/proc/$p/maps" 2>/dev/null && echo "$p" && return; done
}
for c in $CONC; do
  echo "== C=$c"
  python3 bench/serving_overhead.py --concurrency "$c" --warmup 15 --window "$WINDOW" --rounds 1 \
    --server-args "--load-format dummy:$PRESET --dtype bfloat16 ${SERVER_ARGS:-}" \
    --out "$OUT/serving-$PRESET-c$c.json" > "$OUT/serving-$PRESET-c$c.log" 2>&1 &
  harness=$!
  for _ in $(seq 1 240); do
    grep -q "load running" "$OUT/serving-$PRESET-c$c.log" 2>/dev/null && break
    sleep 1
  done
  server=$(pgrep -f -- "-m service --port" | head -1)
  core=$(core_pid "$server")
  echo "server $server core $core"
  sleep 17  # the harness's warm-up: profile inside its measured window
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 > "$OUT/gpu-util-c$c.txt" &
  smi=$!
  # py-spy refuses --native with --nonblocking: a native profile pauses the core for each sample.
  core_spy=(${CORE_SPY_ARGS:-}); [[ " ${core_spy[*]} " == *" --native "* ]] || core_spy+=(--nonblocking)
  py-spy record -r 100 "${core_spy[@]}" -d $((WINDOW - 4)) -p "$core" -f raw -o "$OUT/core-c$c.raw" > "$OUT/core-c$c.spy.log" 2>&1 &
  py-spy record -r 100 -d $((WINDOW - 4)) -p "$server" -f raw -o "$OUT/frontend-c$c.raw" --nonblocking > /dev/null 2>&1
  wait "$harness"
  kill "$smi" 2>/dev/null
  tail -6 "$OUT/serving-$PRESET-c$c.log"
  awk '{s+=$1; n++} END {if (n) printf "GPU utilization: mean %.1f%% over %d samples\n", s/n, n}' "$OUT/gpu-util-c$c.txt"
done
echo "== raw loop"
python3 bench/raw_loop.py --preset "$PRESET" --batch "$(echo $CONC | tr ' ' ,)" --rounds 2 --out "$OUT/raw-$PRESET.json"
