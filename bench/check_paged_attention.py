"""Check the paged decode attention kernel against a naive float32 attention (for a GPU host
without pytest plugins): python bench/check_paged_attention.py"""

import math
import sys

import mlx.core as mx

from service.core.engine import paged_attention
from service.core.engine.paged_attention import paged_decode_attention
from tests.helpers.attention import naive, random_case

print("kernel available:", paged_attention.kernel_available())
worst = 0.0
for dtype in (mx.bfloat16, mx.float32):
    for head_dim, heads, kv_heads in ((64, 9, 3), (64, 32, 8), (128, 32, 8), (256, 16, 8)):
        lengths = [1, 37, 5, 300, 1029, 64]
        case = random_case(len(lengths), heads, kv_heads, head_dim, lengths, dtype)
        scale = 1 / math.sqrt(head_dim)
        err = mx.abs(paged_decode_attention(*case, scale).astype(mx.float32) - naive(*case, scale))
        err = err.max().item()
        limit = 2e-2 if dtype == mx.bfloat16 else 1e-4
        print(f"{dtype} D={head_dim} H={heads} KVH={kv_heads}: max error {err:.2e} (limit {limit})")
        worst = max(worst, err / limit)
sys.exit(0 if worst <= 1 else 1)
