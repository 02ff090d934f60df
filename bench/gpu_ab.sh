#!/usr/bin/env bash
# An A/B of two versions of the code on one GPU host, in alternating processes (hosts drift
# within a call and vary by half between calls, so only versions measured side by side compare).
#
#   A=DIR B=DIR MODE=core|server PAIRS=3 OUT=/tmp/out bash bench/gpu_ab.sh
#
# A and B are trees holding service/, bench/, client/ and mlxserve/ (e.g. `git archive REV
# service bench client mlxserve | tar -x -C DIR`); each runs with only itself on PYTHONPATH
# beside /tmp/site and TOK (a directory from scripts/tokenizer_gguf.py, for hosts without the
# embedded model's package). Each pair runs B, then A.
# - core: `bench/step_anatomy.py --paths raw,core` at BATCH (default 64,256), ROUNDS (3) each: the
#   engine core alone and the raw mlx-lm loop in the same process;
# - server: `bench/gpu_run.sh` with RUNS="PRESET:1:raw:90" at CONC (64,256): ours through gRPC
#   beside the raw loop; summarize with `python -m bench.rounds OUT/PRESET-{a,b}-N.json`.
# ENV_A / ENV_B: extra environment for that side's processes (A=B=DIR with ENV_B=
# "MLX_MAX_OPS_PER_BUFFER=400" compares an MLX setting on one tree; the raw loop gets it too).
# Results: OUT/{core,server}-{a,b}-N.json (server: OUT/PRESET-{a,b}-N.json). Expects MLX
# installed under /tmp/site (docs/offline-gpu-install.md). Env: PRESET (smollm2-135m), BUDGET_S
# (580: pairs that would not finish in time are skipped), DTYPE (bfloat16).
set -uo pipefail
: "${A:?A=DIR}" "${B:?B=DIR}"
MODE=${MODE:-core}; PAIRS=${PAIRS:-3}; OUT=${OUT:-/tmp/out}; PRESET=${PRESET:-smollm2-135m}
BATCH=${BATCH:-64,256}; ROUNDS=${ROUNDS:-3}; DTYPE=${DTYPE:-bfloat16}; CONC=${CONC:-64,256}; BUDGET_S=${BUDGET_S:-580}
A=$(cd "$A" && pwd); B=$(cd "$B" && pwd); TOK=${TOK:+$(cd "$TOK" && pwd)}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
start=$(date +%s)
need=$([ "$MODE" = server ] && echo 140 || echo 60)
for n in $(seq 1 "$PAIRS"); do
  for side in b a; do
    dir=$([ $side = a ] && echo "$A" || echo "$B")
    extra=$([ $side = a ] && echo "${ENV_A:-}" || echo "${ENV_B:-}")
    left=$((BUDGET_S - ($(date +%s) - start)))
    if [ "$left" -lt "$need" ]; then echo "== stop: ${left}s left"; break 2; fi
    echo "== $MODE $side pair $n (${left}s left)${extra:+ with $extra}"
    export PYTHONPATH=/tmp/site${TOK:+:$TOK}:$dir
    if [ "$MODE" = core ]; then
      (cd "$dir" && env $extra timeout $((left - 5)) python3 bench/step_anatomy.py --preset "$PRESET" --dtype "$DTYPE" \
        --paths raw,core --batch "$BATCH" --steps 64 --rounds "$ROUNDS" \
        --out "$OUT/core-$side-$n.json" 2>&1 | grep median)
    else
      (cd "$dir" && env $extra CHECK=0 RUNS="$PRESET:1:raw:90" CONC="$CONC" BUDGET_S=135 \
        OUT="$OUT/server-$side-$n" TAG="-$side-$n" bash bench/gpu_run.sh 2>&1 | grep "ours C=")
      cp "$OUT/server-$side-$n/$PRESET-$side-$n.json" "$OUT/" 2>/dev/null
      rm -rf "$OUT/server-$side-$n"
    fi
  done
done
echo "== total $(( $(date +%s) - start ))s"
