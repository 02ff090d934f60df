"""The primitives of one decode step at batch B, by kind: the raw mlx-lm loop's (the model called
with mlx-lm's prompt cache) beside our model runner's step (its compiled decode graph where the
platform has one). On MLX's CUDA backend each primitive costs host work when the step is
evaluated, so the count is what the host pays per step. Prints both tables; `--out` writes them
as JSON.

    python bench/decode_primitives.py --preset smollm2-135m --dtype bfloat16 --batch 256
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step_anatomy import _Rows  # noqa: E402

_NODE = re.compile(r'label ="([^"]+)", shape=rectangle')


def primitives(output: mx.array) -> collections.Counter[str]:
    """The primitives of `output`'s graph (not evaluated), by name."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as dot:
        mx.export_to_dot(dot.name, output)
        text = Path(dot.name).read_text()
    return collections.Counter(label.split()[0] for label in _NODE.findall(text))


def raw_step(preset: str, dtype: str, batch: int) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    from service.core.models.loader import parse_dtype
    from service.core.models.presets import dummy_model

    model, _ = dummy_model(preset, parse_dtype(dtype))
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.random.randint(17, 500, (batch, 32)), cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    return mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)


def runner_step(preset: str, dtype: str, batch: int) -> mx.array:
    from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
    from service.core.runtime import Runtime
    from service.core.scheduler.plan import StepPlan

    config = CoreConfig(
        model=ModelConfig(load_format=f"dummy:{preset}", dtype=dtype),
        scheduling=SchedulingConfig(max_batch_size=batch, max_queue_depth=4096),
    )
    runtime = Runtime(config)
    runtime.load()
    rows, runner, slots = _Rows(runtime, batch), runtime.runner, list(range(batch))
    for _ in range(3):  # past the first steps' tracing
        runner.collect(runner.submit(StepPlan(rows._next(), decode=slots)))
    forward = runner.submit(StepPlan(rows._next(), decode=slots), dispatch=False).decode
    assert forward is not None and forward.tokens is not None
    return forward.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from service.common.logging import configure_logging

    configure_logging("warning", "console")
    counts = {
        "raw": primitives(raw_step(args.preset, args.dtype, args.batch)),
        "runner": primitives(runner_step(args.preset, args.dtype, args.batch)),
    }
    for path, count in counts.items():
        print(f"{path}: {sum(count.values())} primitives")
        for name, n in count.most_common():
            print(f"  {n:6d} {name}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **counts}))


if __name__ == "__main__":
    main()
