"""The raw mlx-lm decode loop on a preset's random weights: tokens/s at batch sizes B, nothing
else (no server, no scheduling). The ceiling our server is compared with on a GPU host.

    python bench/raw_loop.py --preset smollm2-135m --batch 1,64,256 --steps 128 --out raw.json
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from service.core.models.loader import parse_dtype
from service.core.models.presets import dummy_model


def decode_rate(model, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(17, 500, (batch, prompt_len))
    logits = model(prompt, cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)

    def step(tokens: mx.array) -> mx.array:
        return mx.argmax(model(tokens[:, None], cache=cache)[:, -1], axis=-1)

    started = time.perf_counter()
    nxt = step(token)
    mx.async_eval(nxt)
    for _ in range(steps - 1):
        cur, nxt = nxt, step(nxt)
        mx.async_eval(nxt)
        cur.tolist()
    nxt.tolist()
    seconds = time.perf_counter() - started
    return {"batch": batch, "step_ms": seconds / steps * 1000, "tok_s": batch * steps / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, _ = dummy_model(args.preset, parse_dtype(args.dtype))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        decode_rate(model, batch, args.prompt_len, 8)  # warm-up: kernels, CUDA graphs
        for r in range(args.rounds):
            row = {**decode_rate(model, batch, args.prompt_len, args.steps), "round": r}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
