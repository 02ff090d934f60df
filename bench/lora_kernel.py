"""What the CUDA LoRA kernel adds to a decode step, on a model's shapes (not a test).

A stack of decoder-like layers of the preset's sizes (random bf16 weights; attention replaced by
a cheap stand-in that reads q, k and v, so the step is the projections' and the kernels' work),
run as one compiled function per step, and timed: base projections only, and base plus
`lora_kernel.fused_add` as the server calls it (q/k/v in one call, o, gate/up in one call, down)
for --tokens rows spread over --adapters adapters and the base model. With --against REV the same
steps run with the kernel of another revision too (`git show REV:service/core/models/
lora_kernel.py`, or a copy of that file), alternating, for an A/B in one process; --against may
be given several times. First, each kernel's output is checked against the MLX-op reference
(`reference_fused_add`). With --floor, a variant of this revision's kernel whose every block only
copies y (same grid, inputs and outputs: it fails the check) runs beside them: the cost of
launching the kernels, which no faster arithmetic removes. With --pair, the same update from
`shrink` and `expand_add` per module (each token's x @ A computed once, not once per block of
its outputs): at --tokens of a prefill pass (thousands) the candidate to A/B. With --prefill, the
MLX-op forms a prefill pass could take instead: `gather` (mlx-lm's products per row of
--row-tokens tokens, `mx.gather_mm` over the stacks, as the CPU path runs them) and `dense` (every
token times all the stacks' A and B in float32, the other adapters' ranks masked out: two matmuls
a module) and `gather_mm (sorted)` (tokens sorted by slot, mlx-lm's products as one grouped
`gather_mm` each, as mlx-lm's MoE layers run theirs; with stacks in our layout, and as transposed
views, the layout of mlx-lm's MoE weights), and `row kernels` (`lora_kernel.rows_add`: tiles of
a row's tokens sharing each read of A and B; --rows times them without the MLX-op forms).
--adapter-dtype float32 is what `mlx_lm lora` saves. With --kernel-times, instead of steps: the
GPU's own time for each form's call of each group a layer makes (q/k/v, o, gate/up, down), read
from CUPTI through PyTorch's profiler, and whether its outputs equal this revision's kernel's bit
for bit: on a host where the stand-in step is bound by the host, the steps show no kernel's GPU
time.
Rows of --row-tokens tokens share an adapter, as a prefill pass's prompts do.

    python3 bench/lora_kernel.py --preset llama-3.1-8b --tokens 64 --adapters 8 --rank 16 \
        [--against REV ...] [--floor] [--pair] [--prefill --row-tokens 32] [--kernel-times] \
        [--out FILE.json]

Prints the median step ms (and range) of each variant over --replicates rounds, each step
timed alone and overlapped (queued while the last one runs, as the engine runs them, with the
host's share), and writes JSON.
Without MLX's CUDA backend, fused_add is its MLX-op reference: a smoke run only.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.host_cost import pipelined  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.shapes import projections  # noqa: E402
from service.core.models import lora_kernel  # noqa: E402
from service.core.models.presets import preset_config  # noqa: E402

FusedAdd = Callable[[mx.array, list[lora_kernel.Part], mx.array], list[mx.array]]


class Stepped:
    """This revision's `fused_add` with a forward's counts as the server gives them: one
    `Counts` a step (`fresh`), its launches each taking a stretch."""

    def __init__(self) -> None:
        self.counts = lora_kernel.Counts()

    def fresh(self) -> None:
        self.counts = lora_kernel.Counts()

    def __call__(
        self, x: mx.array, parts: list[lora_kernel.Part], scale: mx.array
    ) -> list[mx.array]:
        return lora_kernel.fused_add(x, parts, scale, self.counts)


def kernel_of(rev: str) -> FusedAdd:
    """`fused_add` as it was at git revision `rev`, or from a copy of lora_kernel.py at that
    path (for a checkout whose history is not there)."""
    if Path(rev).is_file():
        return _load(Path(rev).read_text(), Path(rev).stem)
    source = subprocess.run(
        ["git", "show", f"{rev}:service/core/models/lora_kernel.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return _load(source, f"lora_kernel_{rev}")


def floor_source(source: str) -> str:
    """lora_kernel.py's text with every block taking the zero-update branch (y copied), its
    kernel under a name of its own."""
    branch = "  if (s == 0) {"
    if source.count(branch) != 1:
        raise SystemExit("--floor: the kernel's zero-update branch is not where it was")
    return source.replace(branch, "  if (true) {").replace("mlxserve_lora_fused", "lora_floor")


def copy_floor() -> FusedAdd:
    """This revision's `fused_add` as `floor_source` makes it: the launches' cost alone."""
    source = (ROOT / "service/core/models/lora_kernel.py").read_text()
    return _load(floor_source(source), "lora_kernel_floor")


def _load(source: str, name: str) -> FusedAdd:
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module.fused_add


def build(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    cfg = preset_config(args.preset)
    shapes = projections(cfg)  # module: (in, out)
    slots, rank, dt = args.adapters + 1, args.rank, getattr(mx, args.adapter_dtype)

    def rnd(*shape: int, scale: float) -> mx.array:
        return (mx.random.normal(shape) * scale).astype(dt)

    layers = []
    for _ in range(args.layers or cfg["num_hidden_layers"]):
        layer: dict[str, Any] = {}
        for m, (i, o) in shapes.items():
            a_t = mx.concatenate([mx.zeros((1, rank, i), dt), rnd(slots - 1, rank, i, scale=0.05)])
            b = mx.concatenate([mx.zeros((1, rank, o), dt), rnd(slots - 1, rank, o, scale=0.05)])
            layer[m] = (rnd(o, i, scale=0.02).astype(mx.bfloat16), a_t, b)
        layers.append(layer)
        mx.eval(layer)
    return layers, shapes


def forward(layers: list[dict[str, Any]], kernel: FusedAdd | None, idx, scale) -> Callable:
    def norm(x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, 1e-5)

    def project(layer: dict[str, Any], h: mx.array, names: list[str]) -> list[mx.array]:
        ys = [h @ layer[m][0].T for m in names]
        if kernel is None:
            return ys
        parts = [lora_kernel.Part(y, layer[m][1], layer[m][2], idx) for m, y in zip(names, ys)]
        return kernel(h, parts, scale)

    def step(x: mx.array) -> mx.array:
        if isinstance(kernel, Stepped):
            kernel.fresh()  # a forward's counts, one fill for its launches
        for layer in layers:
            h = norm(x)
            q, k, v = project(layer, h, ["q", "k", "v"])
            reps = q.shape[-1] // k.shape[-1]
            att = q + mx.tile(k + v, (1, reps))  # stands in for attention: reads q, k and v
            (o,) = project(layer, att, ["o"])
            x = x + o
            h = norm(x)
            g, u = project(layer, h, ["gate", "up"])
            (d,) = project(layer, g * mx.sigmoid(g) * u, ["down"])
            x = x + d
        return x

    return mx.compile(step)


def gather_add(row_tokens: int) -> FusedAdd:
    """Each part's update from `mx.gather_mm` per row of `row_tokens` tokens (one slot a row)."""

    def add(x: mx.array, parts: list[lora_kernel.Part], scale: mx.array) -> list[mx.array]:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0] // row_tokens
        x3 = flat.reshape(rows, row_tokens, -1)
        if not lora_kernel.available():  # MLX's CPU gather_mm takes float32 only
            x3 = x3.astype(mx.float32)
        per_token = scale.reshape(rows, row_tokens, 1)
        out = []
        for part in parts:
            slots = part.idx.reshape(rows, row_tokens)[:, 0]
            a, b = _swapped(part.a_t).astype(x3.dtype), part.b.astype(x3.dtype)
            z = mx.gather_mm(x3, a, rhs_indices=slots)
            d = per_token * mx.gather_mm(z, b, rhs_indices=slots)
            base = part.base()
            out.append(base + d.astype(base.dtype).reshape(base.shape))
        return out

    return add


def rows_add(row_tokens: int) -> FusedAdd:
    """`lora_kernel.rows_add`: tiles of one row's tokens sharing each read of A and B."""

    def add(x: mx.array, parts: list[lora_kernel.Part], scale: mx.array) -> list[mx.array]:
        return lora_kernel.rows_add(x, parts, scale, row_tokens)

    return add


_A: dict[int, mx.array] = {}


def _swapped(stack: mx.array) -> mx.array:
    """A stack [S, m, n] as a contiguous [S, n, m], made once per stack: A as [S, in, r] (the
    server's stacks hold it so), B as [S, out, r]."""
    held = _A.get(id(stack))
    if held is None:
        held = _A[id(stack)] = mx.contiguous(stack.swapaxes(1, 2))
        mx.eval(held)
    return held


_CAT: dict[int, tuple[mx.array, mx.array]] = {}


def sorted_add(transposed: bool) -> FusedAdd:
    """Each part's update from `mx.gather_mm` over tokens sorted by slot (`sorted_indices`: a
    grouped product, as mlx-lm's MoE layers run theirs), in the stacks' dtype, then unsorted.
    `transposed`: the stacks as transposed views ([S, in, r] as A^T [S, r, in] swapped, B from a
    [S, out, r] copy), the layout mlx-lm's MoE weights give gather_mm."""

    def add(x: mx.array, parts: list[lora_kernel.Part], scale: mx.array) -> list[mx.array]:
        flat = x.reshape(-1, x.shape[-1])
        out = []
        for part in parts:
            order = mx.argsort(part.idx)
            back = mx.argsort(order)
            slots = part.idx[order]
            if transposed:
                a, b = part.a_t.swapaxes(1, 2), _swapped(part.b).swapaxes(1, 2)
            else:
                a, b = _swapped(part.a_t), part.b
            xs = flat[order][:, None, :]
            if xs.dtype != a.dtype:
                xs = xs.astype(a.dtype)
            z = mx.gather_mm(xs, a, rhs_indices=slots, sorted_indices=True)
            d = mx.gather_mm(z, b, rhs_indices=slots, sorted_indices=True)[:, 0][back]
            base = part.base()
            d = (scale[:, None] * d).astype(base.dtype)
            out.append(base + d.reshape(base.shape))
        return out

    return add


def dense_add(x: mx.array, parts: list[lora_kernel.Part], scale: mx.array) -> list[mx.array]:
    """Each part's update as two float32 matmuls over every slot's ranks (A as [in, S * r], B as
    [S * r, out], made once), the other slots' ranks masked out: exact zeros in the second."""
    flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    tokens = flat.shape[0]
    out = []
    for part in parts:
        slots, rank, width = part.a_t.shape
        cat = _CAT.get(id(part.a_t))
        if cat is None:
            a = mx.contiguous(part.a_t.reshape(slots * rank, width).T.astype(mx.float32))
            cat = _CAT[id(part.a_t)] = (a, part.b.reshape(slots * rank, -1).astype(mx.float32))
            mx.eval(cat)
        mask = (part.idx[:, None] == mx.arange(slots)[None]).astype(mx.float32) * scale[:, None]
        z = (flat @ cat[0]).reshape(tokens, slots, rank) * mask[:, :, None]
        d = z.reshape(tokens, slots * rank) @ cat[1]
        base = part.base()
        out.append(base + d.astype(base.dtype).reshape(base.shape))
    return out


def check(layers, shapes, kernel: FusedAdd, idx, scale, tokens: int) -> float:
    """The largest excess over bf16 rounding of the kernel's outputs against the reference, on
    the first layer's modules (0 or less: within rounding)."""
    worst = -1.0
    layer = layers[0]
    for m, (i, _) in shapes.items():
        x = mx.random.normal((tokens, i)).astype(mx.bfloat16)
        y = x @ layer[m][0].T
        part = lora_kernel.Part(y, layer[m][1], layer[m][2], idx)
        got = kernel(x, [part], scale)[0].astype(mx.float32)
        want = lora_kernel.reference_fused_add(x, [part], scale)[0].astype(mx.float32)
        bound = 2.0**-6 * (mx.abs(want) + mx.abs(want - y.astype(mx.float32))) + 1e-5
        worst = max(worst, (mx.abs(got - want) - bound).max().item())
    return worst


GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # the server's calls in a layer


def kernel_times(
    layers, shapes, kernels: dict[str, FusedAdd | None], idx, scale, tokens: int, calls: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, bool]]]:
    """GPU µs a call of each form, for each call a layer makes (GROUPS, the first layer's
    weights): the kernels' own records (CUPTI, through torch's profiler), summed over the call's
    kernels, median over `calls` calls; and whether its outputs equal this revision's kernel's
    bit for bit."""
    from bench.cuda_timeline import traced

    forms = {name: kernel for name, kernel in kernels.items() if kernel is not None}
    times: dict[str, dict[str, float]] = {name: {} for name in forms}
    same: dict[str, dict[str, bool]] = {name: {} for name in forms}
    layer = layers[0]
    for group in GROUPS:
        # One input and one reference for every form of this call.
        key = "/".join(group)
        x = mx.random.normal((tokens, shapes[group[0]][0])).astype(mx.bfloat16)
        parts = [lora_kernel.Part(x @ layer[m][0].T, layer[m][1], layer[m][2], idx) for m in group]
        want = lora_kernel.fused_add(x, parts, scale)
        mx.eval(x, [part.y for part in parts], want)
        for name, kernel in forms.items():
            got = kernel(x, parts, scale)
            same[name][key] = all(mx.array_equal(g, w).item() for g, w in zip(got, want))

            def run(kernel: FusedAdd = kernel, x: mx.array = x, parts: list = parts) -> None:
                for _ in range(calls):
                    mx.eval(kernel(x, parts, scale))

            _, records = traced(run)
            per_call = [0.0] * calls
            # Records come in start order, each call's kernels after the last call's.
            per_kernel = len(records) // calls
            for i, (start, stop, _) in enumerate(records[: per_kernel * calls]):
                per_call[i // per_kernel] += stop - start
            times[name][key] = statistics.median(per_call)
    return times, same


def time_step(fn: Callable, x: mx.array, steps: int) -> float:
    for _ in range(3):
        mx.eval(fn(x))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=0, help="0: the preset's")
    parser.add_argument("--tokens", type=int, default=64, help="rows of the decode step")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per replicate")
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        help="another kernel: a git revision, or a lora_kernel.py (repeatable)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also the kernel with every block copying y only"
    )
    parser.add_argument(
        "--pair", action="store_true", help="also shrink + expand_add, two kernels a module"
    )
    parser.add_argument(
        "--prefill", action="store_true", help="also the MLX-op forms: gather_mm per row, dense"
    )
    parser.add_argument(
        "--rows", action="store_true", help="also the row kernels (lora_kernel.rows_add)"
    )
    parser.add_argument(
        "--row-tokens", type=int, default=1, help="tokens per row (one adapter a row)"
    )
    parser.add_argument(
        "--adapter-dtype",
        default="bfloat16",
        help="the stacks' dtype (mlx_lm lora saves float32 adapters; the base is bfloat16)",
    )
    parser.add_argument(
        "--kernel-times",
        action="store_true",
        help="instead of steps: GPU µs a call of each form for each call of a layer (needs "
        "PyTorch, whose profiler reads CUPTI)",
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls with --kernel-times")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tokens % args.row_tokens:
        parser.error("--tokens must be a multiple of --row-tokens")
    if not lora_kernel.available():
        print("no CUDA backend: fused_add runs its MLX-op reference (a smoke run, not a figure)")
    mx.random.seed(0)
    if args.kernel_times:
        try:
            import torch  # noqa: F401
        except ImportError:
            parser.error("--kernel-times needs PyTorch (its profiler reads CUPTI's records)")
        args.layers = args.layers or 1  # the kernel times read the first layer only
    layers, shapes = build(args)
    slots = args.adapters + 1
    # Row r's tokens take slot r % slots (slot 0: the base model).
    idx = mx.array([(t // args.row_tokens) % slots for t in range(args.tokens)], mx.int32)
    scale = mx.full((args.tokens,), 2.0, mx.float32)
    kernels: dict[str, FusedAdd | None] = {"base": None, "kernel": Stepped()}
    for rev in args.against:
        kernels[f"kernel@{rev}"] = kernel_of(rev)
    if args.floor:
        kernels["floor (copies y)"] = copy_floor()
    if args.pair:
        kernels["shrink + expand_add"] = lora_kernel.shrink_expand_add
    if args.prefill:
        kernels[f"gather_mm ({args.row_tokens}-token rows)"] = gather_add(args.row_tokens)
        kernels["dense (all slots)"] = dense_add
        kernels["gather_mm (sorted)"] = sorted_add(False)
        kernels["gather_mm (sorted, transposed views)"] = sorted_add(True)
    if args.prefill or args.rows:
        kernels[f"row kernels ({args.row_tokens}-token rows)"] = rows_add(args.row_tokens)
    checks = {}
    for name, k in list(kernels.items()):
        if k is None:
            continue
        try:
            checks[name] = check(layers, shapes, k, idx, scale, args.tokens)
        except (RuntimeError, ValueError) as error:  # e.g. a form this backend does not run
            print(f"check {name}: fails to run ({error}); left out")
            del kernels[name]
    for name, excess in checks.items():
        print(f"check {name}: {'ok' if excess <= 0 else f'off by {excess:.3g} beyond rounding'}")
    if args.kernel_times:
        times, same = kernel_times(layers, shapes, kernels, idx, scale, args.tokens, args.calls)
        print(f"GPU µs a call, {args.tokens} tokens ('!': not this revision's numbers bit for bit)")
        for name, row in times.items():
            cells = "  ".join(
                f"{group} {us:7.1f}{'' if same[name][group] else '!'}" for group, us in row.items()
            )
            print(f"  {name:<24} layer {sum(row.values()):7.1f} | {cells}")
        write_json(args.out, args, checks=checks, kernel_us=times, same=same)
        return
    steps = {name: forward(layers, k, idx, scale) for name, k in kernels.items()}
    x = mx.random.normal((args.tokens, shapes["q"][0])).astype(mx.bfloat16)
    ms: dict[str, list[float]] = {name: [] for name in kernels}
    piped: dict[str, list[tuple[float, float]]] = {name: [] for name in kernels}
    for r in range(args.replicates):
        for name, fn in steps.items():
            ms[name].append(time_step(fn, x, args.steps))
            wall, host = pipelined(fn, x, args.steps)  # seconds a step
            piped[name].append((wall * 1e3, host * 1e3))
        print(f"replicate {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in ms.items()))
    base = ms["base"]
    print(
        f"{args.preset}, {args.tokens} tokens in rows of {args.row_tokens} over {args.adapters} "
        "adapters and the base, "
        f"rank {args.rank}:"
    )
    for name, values in ms.items():
        added = [v - b for v, b in zip(values, base)]
        print(
            f"  {name:<24} step {statistics.median(values):7.2f} ms "
            f"({min(values):.2f}-{max(values):.2f})"
            + ("" if name == "base" else f", added {statistics.median(added):.2f} ms")
        )
        step_ms = statistics.median(p[0] for p in piped[name])
        host_ms = statistics.median(p[1] for p in piped[name])
        print(f"  {'':<24} overlapped steps {step_ms:7.2f} ms, host {host_ms:.2f} ms of it")
    write_json(
        args.out,
        args,
        checks=checks,
        step_ms=ms,
        overlapped={n: [list(p) for p in v] for n, v in piped.items()},
    )


if __name__ == "__main__":
    main()
