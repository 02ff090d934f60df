#!/usr/bin/env bash
# Structured output and many LoRA adapters on one NVIDIA H200, within one device call:
# - bench/structured_output.py on SmolLM2's shape (random bf16 weights, the embedded tokenizer) at
#   C=64: JSON-Schema-constrained against free decoding, in alternating order;
# - bench/multi_lora.py on Llama-3.1-8B's shape at C=64: 8 random rank-16 adapters on all seven
#   projections, streams cycling through them and the base, against the same streams base-only.
#
# Expects MLX and our wheels under /tmp/site and PYTHONPATH set (docs/offline-gpu-install.md).
# Env: OUT (results dir), REPLICATES (3), CONC (64), SO_TOKENS (128), LORA_TOKENS (128).
set -uo pipefail
OUT=${OUT:-/tmp/out}; REPLICATES=${REPLICATES:-3}; CONC=${CONC:-64}
SO_TOKENS=${SO_TOKENS:-128}; LORA_TOKENS=${LORA_TOKENS:-128}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1

echo "== structured output, smollm2-135m, C=$CONC"
timeout 240 python3 bench/structured_output.py --load-format dummy:smollm2-135m --dtype bfloat16 \
  --concurrency "$CONC" --max-tokens "$SO_TOKENS" --replicates "$REPLICATES" \
  --out "$OUT/structured_output-smollm2-c$CONC.json" 2>&1 | grep -v '^{"event"' | tail -30

echo "== LoRA, llama-3.1-8b, C=$CONC, 8 rank-16 adapters"
timeout 300 python3 -m bench.multi_lora --load-format dummy:llama-3.1-8b --dtype bfloat16 \
  --no-plain --adapters 8 --rank 16 --streams "$CONC" --max-tokens "$LORA_TOKENS" \
  --replicates "$REPLICATES" --vocab 49152 --out "$OUT/multi_lora-llama-3.1-8b-c$CONC.json" 2>&1 \
  | tail -20
