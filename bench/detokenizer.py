"""A front end's detokenization per generated token, on the embedded tokenizer: the token-bytes
path (what the server uses for a byte-level tokenizer) beside decoding token windows, with and
without a stop string. Prints µs per token (best of --rounds) and writes JSON (`--out`):

    env $(python -m service.common.blas --env) python bench/detokenizer.py --out d.json
"""

from __future__ import annotations

import argparse
import json
import time

from service.common.tokenizer import tokenizer_from_gguf
from service.core.models.gguf import read_gguf_metadata
from service.core.models.loader import embedded_gguf_path
from service.frontend.detokenizer import IncrementalDetokenizer

TEXT = "The quick brown fox jumps over the lazy dog, café ☕ 日本語 🎉. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    tok = tokenizer_from_gguf(read_gguf_metadata(embedded_gguf_path()))
    assert tok.text_bytes is not None
    ids = tok.encode(TEXT * (args.tokens // 10 + 1))[: args.tokens]
    rows = []
    for path in ("bytes", "decode"):
        for stops in ((), ("</s>",)):
            best = float("inf")
            for _ in range(args.rounds):
                detok = IncrementalDetokenizer(
                    tok.decode,
                    stops,
                    tok.ends_mid_character,
                    tok.text_bytes if path == "bytes" else None,
                )
                started = time.perf_counter()
                for i in ids:
                    detok.push(i)
                best = min(best, time.perf_counter() - started)
            rows.append({"path": path, "stop": bool(stops), "us_per_token": best / len(ids) * 1e6})
            print(f"{path:>6} stop={bool(stops)!s:5} {rows[-1]['us_per_token']:.2f} us/token")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": len(ids), "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
