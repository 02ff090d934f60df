"""Where a decode step's time goes at batch B, in one process on a preset's random weights: the
raw mlx-lm loop beside our model runner's steady decode (no scheduler) and the engine core's
(scheduler and loop, no gRPC).

For the raw loop and the runner each step is split into host phases: building the step's graph
(the model call, or our compiled graph's replay), `mx.async_eval` (MLX's synchronous host work:
kernel set-up, launches, CUDA-graph commits) and the wait for the tokens; the remainder of a
runner step is our Python. Prints one line per (path, B, round) and writes JSON (`--out`):

    python bench/step_anatomy.py --preset smollm2-135m --batch 64,256 --steps 64 --out a.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

_PHASES: dict[str, float] = defaultdict(float)


@contextmanager
def _timed(name: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        _PHASES[name] += time.perf_counter() - started


def _wrap(owner: Any, attr: str, phase: str) -> None:
    original = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with _timed(phase):
            return original(*args, **kwargs)

    setattr(owner, attr, timed)


def raw_round(model: Any, batch: int, steps: int) -> dict[str, float]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(17, 500, (batch, 32))
    token = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(token)

    def step(tokens: mx.array) -> mx.array:
        with _timed("build"):
            return mx.argmax(model(tokens[:, None], cache=cache)[:, -1], axis=-1)

    _PHASES.clear()
    started, cpu = time.perf_counter(), time.process_time()
    nxt = step(token)
    with _timed("async_eval"):
        mx.async_eval(nxt)
    for _ in range(steps - 1):
        cur, nxt = nxt, step(nxt)
        with _timed("async_eval"):
            mx.async_eval(nxt)
        with _timed("wait"):
            cur.tolist()
    nxt.tolist()
    return _summary("raw", batch, steps, started, cpu)


def raw_prefill(model: Any, batch: int, width: int) -> list[dict[str, Any]]:
    """The raw loop's prefill of `batch` prompts of `width` tokens in one forward (every prompt
    the same length, so no padding): the anchor for the runner's prefill passes."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for attempt in ("cold", "warm"):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(17, 500, (batch, width))
        mx.eval(prompt)
        started = time.perf_counter()
        mx.eval(mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1))
        seconds = time.perf_counter() - started
        out.append(
            {
                "path": f"rawprefill-{attempt}",
                "batch": batch,
                "width": width,
                "total_ms": seconds * 1e3,
                "step_ms": seconds * 1e3,
            }
        )
        _print(out[-1])
    return out


class _Rows:
    """B rows joined and prefilled once, then decoded step after step by the runner alone."""

    def __init__(self, runtime: Any, batch: int) -> None:
        from service.core.scheduler.plan import Chunk, RowJoin, StepPlan
        from service.protocol import SamplingParams

        self.runtime, self.batch, self.step = runtime, batch, 0
        kv, joins, tables, chunks = runtime.kv, [], [], []
        self.blocks = []
        for slot in range(batch):
            seq = kv.new_sequence(False)
            kv.ensure_slots(seq, 32 + 1024)
            self.blocks.append(seq)
            joins.append(RowJoin(slot, f"s{slot}", SamplingParams(), [1] * 32, 0))
            tables.append((slot, list(seq.block_ids)))
            chunks.append(Chunk(slot, list(range(17, 49)), True))
        update = kv.take_update()
        plan = StepPlan(self._next(), joins=joins, tables=tables, capacity=update.capacity)
        plan.prefill = [chunks[i : i + 16] for i in range(0, batch, 16)]
        runtime.runner.collect(runtime.runner.submit(plan))

    def _next(self) -> int:
        self.step += 1
        return self.step

    def round(self, steps: int) -> dict[str, float]:
        from service.core.scheduler.plan import StepPlan

        runner, slots = self.runtime.runner, list(range(self.batch))
        _PHASES.clear()
        started, cpu = time.perf_counter(), time.process_time()
        pending = runner.submit(StepPlan(self._next(), decode=slots))
        for _ in range(steps - 1):
            nxt = runner.submit(StepPlan(self._next(), decode=slots), dispatch=False)
            runner.collect(pending)
            runner.dispatch(nxt)
            pending = nxt
        runner.collect(pending)
        return _summary("runner", self.batch, steps, started, cpu)

    def release(self) -> None:
        """The rows leave the runner and give their blocks back."""
        from service.core.scheduler.plan import RowLeave, StepPlan

        leaves = [RowLeave(s, True) for s in range(self.batch)]
        self.runtime.runner.collect(
            self.runtime.runner.submit(StepPlan(self._next(), leaves=leaves))
        )
        for seq in self.blocks:
            self.runtime.kv.free_sequence(seq)


def prefill_spec(spec: str) -> tuple[int, int, int, int]:
    """--prefill's ROWSxPER_PASSxWIDTH[+PREFIX] as (rows, per_pass, width, prefix)."""
    shape, _, prefix = spec.partition("+")
    rows, per_pass, width = (int(x) for x in shape.split("x"))
    return rows, per_pass, width, int(prefix or 0)


def prefill_rounds(
    runtime: Any, batch: int, per_pass: int, width: int, prefix: int = 0
) -> list[dict[str, Any]]:
    """Prefill `batch` rows of `width` tokens in forwards of `per_pass` rows, twice: the first
    time meets every new shape, the second replays them. `prefix`: each row first prefills that
    many tokens (untimed), so the timed passes are chunks after a cached prefix, as a burst of
    prompts sharing a chat template's blocks runs them."""
    from service.core.scheduler.plan import Chunk, RowJoin, RowLeave, StepPlan
    from service.protocol import SamplingParams

    runner, kv, out = runtime.runner, runtime.kv, []

    def passes(chunks: list[Chunk]) -> None:
        for i in range(0, batch, per_pass):
            runner.collect(runner.submit(StepPlan(-1, prefill=[chunks[i : i + per_pass]])))

    for attempt in ("cold", "warm"):
        joins, tables, chunks, firsts, seqs = [], [], [], [], []
        for slot in range(batch):
            seq = kv.new_sequence(False)
            kv.ensure_slots(seq, prefix + width + 64)
            seqs.append(seq)
            prompt = [1] * (prefix + width)
            joins.append(RowJoin(slot, f"p{attempt}{slot}", SamplingParams(), prompt, 0))
            tables.append((slot, list(seq.block_ids)))
            ids = [17 + (slot + i) % 400 for i in range(prefix + width)]
            firsts.append(Chunk(slot, ids[:prefix], False))
            chunks.append(Chunk(slot, ids[prefix:], True))
        update = kv.take_update()
        runner.collect(
            runner.submit(StepPlan(-1, joins=joins, tables=tables, capacity=update.capacity))
        )
        if prefix:
            passes(firsts)
        started = time.perf_counter()
        passes(chunks)
        seconds = time.perf_counter() - started
        out.append(
            {
                "path": f"prefill-{attempt}",
                "batch": batch,
                "per_pass": per_pass,
                "width": width,
                "prefix": prefix,
                "total_ms": seconds * 1e3,
                "step_ms": seconds * 1e3 / -(-batch // per_pass),
            }
        )
        _print(out[-1])
        leaves = [RowLeave(s, True) for s in range(batch)]
        runner.collect(runner.submit(StepPlan(-1, leaves=leaves)))
        for seq in seqs:
            kv.free_sequence(seq)
    return out


def _summary(path: str, batch: int, steps: int, started: float, cpu: float) -> dict[str, float]:
    seconds = time.perf_counter() - started
    cpu_s = time.process_time() - cpu
    row: dict[str, Any] = {
        "path": path,
        "batch": batch,
        "step_ms": seconds / steps * 1e3,
        "cpu_ms": cpu_s / steps * 1e3,
        "tok_s": batch * steps / seconds,
    }
    for name, total in _PHASES.items():
        row[f"{name}_ms"] = total / steps * 1e3
    if path == "runner":
        known = sum(v for k, v in _PHASES.items() if k != "read")
        row["python_ms"] = row["step_ms"] - known * 1e3 / steps - row.get("read_ms", 0.0)
    return row


def core_round(
    runtime: Any, batch: int, max_tokens: int, seed: int, adapters: Sequence[str] = ("",)
) -> dict[str, float]:
    """B requests at once, max_tokens each: tok/s once every row decodes (the window after the
    last first token), the core's scheduler and loop included. Row i uses adapter
    adapters[i % len(adapters)] ("": the base model)."""
    import threading

    from service.core.scheduler.request import Request
    from service.protocol import GenerationRequest

    class Sink:
        batch_key = "anatomy"

        def __init__(self) -> None:
            self.tokens, self.finished, self.first = 0, 0, 0
            self.marks: list[tuple[float, int]] = []
            self.done = threading.Event()

        def deliver(self, outputs: Any) -> None:
            self.tokens += len(outputs.tokens)
            self.marks.append((time.perf_counter(), self.tokens))
            self.finished += len(outputs.finals)
            if self.finished >= batch:
                self.done.set()

    sink = Sink()
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for i in range(batch):
        prompt = tuple(int(t) for t in rng.integers(17, 500, 32))
        request = GenerationRequest(
            f"c{seed}-{i}",
            prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            cache_prompt=False,
            adapter=adapters[i % len(adapters)],
        )
        runtime.loop.submit(Request(request, sink, rid=seed * 100000 + i))
    sink.done.wait(600)
    # The steady window: from the moment every row has its first token (tokens >= 2B: each
    # row's first token plus a step) to the last 10% of the tokens.
    total = batch * max_tokens
    times = [t for t, n in sink.marks if 2 * batch <= n <= 0.9 * total]
    counts = [n for t, n in sink.marks if 2 * batch <= n <= 0.9 * total]
    steady = (counts[-1] - counts[0]) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    ready = next((t for t, n in sink.marks if n >= batch), started) - started
    whole = sink.marks[-1][0] - started if sink.marks else 0.0
    return {
        "path": "core",
        "batch": batch,
        "tok_s": steady,
        "step_ms": batch / steady * 1e3 if steady else 0.0,
        "all_first_ms": ready * 1e3,
        # The whole burst, admission to the last token, as the harness's burst rounds count it.
        "round_tok_s": total / whole if whole else 0.0,
    }


def _spin() -> None:
    while True:
        pass


def _burn(n: int) -> list[Any]:
    """n daemon processes spinning a core each (killed at the end, or with this one)."""
    import multiprocessing

    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    return procs


def _print(row: dict[str, Any]) -> None:
    parts = [f"{row['path']:>6} B={row['batch']:<4}"]
    for key, value in row.items():
        if key not in ("path", "batch"):
            parts.append(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}")
    print(" ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core-tokens", type=int, default=256)
    parser.add_argument("--paths", default="raw,runner,core")
    parser.add_argument(
        "--prefill",
        default="",
        help="prefill timings, cold then warm: ROWSxPER_PASSxWIDTH[+PREFIX],... (e.g. "
        "256x16x32, or 256x256x24+16: chunks of 24 after 16 cached tokens a row); the runner in "
        "passes of PER_PASS rows, the raw loop (with --paths raw) in one forward of the whole "
        "prompts",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="mx.disable_compile() first: every path builds its graph op by op (an A/B of "
        "mx.compile per batch size)",
    )
    parser.add_argument(
        "--span-floor",
        type=int,
        help="the runner's fewest key positions a padded pass attends over (runner."
        "MIN_PADDED_SPAN), to see what the floor costs a burst of short prompts",
    )
    parser.add_argument(
        "--exact-width",
        action="store_true",
        help="the runner pads a pass's width and span to multiples of 16 instead of powers of "
        "two (runner.shape_bucket), to see what the padding costs",
    )
    parser.add_argument(
        "--burners",
        type=int,
        default=0,
        help="processes that keep a core busy each while this runs (what a server's front ends "
        "and a benchmark's clients on the same host take from the engine core's threads)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.no_compile:
        mx.disable_compile()
    burners = _burn(args.burners)
    from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
    from service.common.logging import configure_logging
    from service.core.engine import runner as runner_module
    from service.core.models.loader import parse_dtype
    from service.core.models.presets import dummy_model
    from service.core.runtime import Runtime

    configure_logging("warning", "console")
    # Exploration only: what the runner's padding of multi-token passes costs.
    if args.span_floor is not None:
        runner_module.MIN_PADDED_SPAN = args.span_floor
    if args.exact_width:
        runner_module.shape_bucket = lambda n: -(-n // 16) * 16
    paths = args.paths.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    prefills = [prefill_spec(spec) for spec in args.prefill.split(",") if spec]
    rows: list[dict[str, Any]] = []
    if "raw" in paths:
        model, _ = dummy_model(args.preset, parse_dtype(args.dtype))
        mx.eval(model.parameters())
        for batch, _, width, prefix in prefills:
            # The raw loop caches nothing: it runs a prompt's prefix and chunk as one.
            rows.extend(raw_prefill(model, batch, width + prefix))
    for batch in batches:
        for _ in range(args.rounds):
            if "raw" in paths:
                rows.append(raw_round(model, batch, args.steps))
                _print(rows[-1])
    widest = batches + [batch for batch, *_ in prefills]
    if "runner" in paths or "core" in paths:
        config = CoreConfig(
            model=ModelConfig(load_format=f"dummy:{args.preset}", dtype=args.dtype),
            scheduling=SchedulingConfig(max_batch_size=max(widest), max_queue_depth=4096),
        )
        runtime = Runtime(config)
        if "runner" in paths:
            runtime.load()
            runner = runtime.runner
            if runner.decode_graph is not None:
                _wrap(runner.decode_graph, "logits", "build")
            _wrap(runner_module.mx, "async_eval", "async_eval")
            _wrap(runner, "_read", "read")
            for batch, per_pass, width, prefix in prefills:
                rows.extend(prefill_rounds(runtime, batch, per_pass, width, prefix))
            for batch in batches:
                rows_ = _Rows(runtime, batch)
                for _ in range(args.rounds):
                    rows.append(rows_.round(args.steps))
                    _print(rows[-1])
                rows_.release()
            runtime = Runtime(config)
        if "core" in paths:
            runtime.start()
            runtime.wait_ready()
            for batch in batches:
                for r in range(args.rounds):
                    rows.append(core_round(runtime, batch, args.core_tokens, r))
                    _print(rows[-1])
            runtime.shutdown()
    for burner in burners:
        burner.terminate()
    by: dict[tuple[str, int], list[float]] = defaultdict(list)
    for row in rows:
        by[(row["path"], row["batch"])].append(row["step_ms"])
    for (path, batch), steps in sorted(by.items()):
        print(
            f"{path:>6} B={batch}: step median {statistics.median(steps):.2f} ms "
            f"({min(steps):.2f}-{max(steps):.2f})"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
