"""Many LoRA adapters in one batch, through the real server (not a test).

Starts two servers on the same model (default: the embedded SmolLM2-135M): one serving
--adapters random mlx-lm adapters (rank --rank on --keys of every layer, written here in mlx-lm's
format), one with none. Each replicate runs, one after the other:

- `mixed`: --streams concurrent greedy streams on the adapter server, their adapters cycling
  through a0 a1 ... and the base model (for 4 adapters and 8 streams: a0 a1 a2 a3 base base a0
  a1), every row in one batch;
- `base`: the same streams, none naming an adapter, on the same server;
- `no adapters`: the same streams on the server without adapters (what the wrappers cost when no
  row uses them).

Each stream sends its own random prompt (--prompt-tokens ids, no prefix cache) and generates
exactly --max-tokens tokens. tok/s = generated tokens / wall time from the first send to the last
token; decode tok/s = the tokens after the last stream's first token / the time from then to the
last token (prefill left out); tok per core CPU s = generated tokens / the CPU time the engine
core used meanwhile (all its threads), the figure least moved by other load on a shared machine.
Three replicates (--replicates): the table gives the median and the range; the ratios are mixed
/ base of the same replicate. Every other replicate runs its variants in reverse order. Memory:
each adapter's weights as GetModelInfo reports them, and the engine core's resident memory with
the adapters less without.

--against DIR compares two trees in the same minutes: DIR, another checkout (a branch's
worktree), serves the same adapters from a third server, and each replicate runs its `mixed` and
`base` rounds too (`against mixed`, `against base`). Its ratio over this tree's, replicate by
replicate, is the comparison: between separate runs a GPU host's speed moves more than a
kernel's change does.

    PYTHONPATH=. .venv/bin/python -m bench.multi_lora [--adapters 4] [--streams 8] [--rank 8]
        [--max-tokens 64] [--model DIR] [--out bench/results/cpu/multi_lora.json]

(The servers preload OpenBLAS for MLX by themselves.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serving_overhead import CLK_TCK, cpu_ticks, server_processes
from bench.shapes import ATTENTION, projections
from client.bench.cli import git_state
from client.bench.server import ServerProcess
from client.client import GenerationClient, build_request

ROOT = Path(__file__).resolve().parents[1]
ALL_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def model_dims(
    model: str | None, load_format: str = "auto"
) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, per-layer module name -> (input dims, output dims)) of a llama-family model."""
    if load_format.startswith("dummy:"):
        from service.core.models.presets import preset_config

        args = preset_config(load_format.removeprefix("dummy:"))
    elif model is None:
        import mlx.core as mx

        from service.common.model_source import embedded_gguf_path
        from service.core.models.gguf import llama_args_from_gguf

        tensors, metadata = mx.load(str(embedded_gguf_path()), return_metadata=True)
        args = vars(llama_args_from_gguf(metadata, set(tensors)))
    else:
        args = json.loads((Path(model) / "config.json").read_text())
    dims = {
        f"{'self_attn' if m in ATTENTION else 'mlp'}.{m}_proj": shape
        for m, shape in projections(args).items()
    }
    return args["num_hidden_layers"], dims


def write_adapter(
    path: Path,
    layers: int,
    dims: dict[str, tuple[int, int]],
    keys: Sequence[str],
    rank: int,
    seed: int,
) -> None:
    """A random adapter in `mlx_lm lora`'s format (its values do not change the cost)."""
    import mlx.core as mx

    mx.random.seed(seed)
    weights = {}
    for layer in range(layers):
        for key in keys:
            n_in, n_out = dims[key]
            name = f"model.layers.{layer}.{key}"
            weights[f"{name}.lora_a"] = mx.random.uniform(-(n_in**-0.5), n_in**-0.5, (n_in, rank))
            weights[f"{name}.lora_b"] = mx.random.normal((rank, n_out)) * 0.01
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": -1,
        "lora_parameters": {"rank": rank, "scale": 20.0, "dropout": 0.0, "keys": list(keys)},
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def run_streams(
    server: ServerProcess,
    adapters: list[str],
    prompt_tokens: int,
    max_tokens: int,
    vocab: int,
    seed: int,
) -> dict[str, float]:
    """One round: a stream per entry of `adapters` ("" = the base model), all at once."""
    target = server.target
    cores = server_processes(server._proc.pid)["core"]  # type: ignore[union-attr]
    ticks_before = sum(cpu_ticks(pid) or 0 for pid in cores)
    rng = random.Random(seed)
    starts: list[float] = []
    firsts: list[float] = []
    arrivals: list[tuple[float, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(adapter: str) -> None:
        prompt = [rng.randrange(200, vocab) for _ in range(prompt_tokens)]
        request = build_request(
            token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            cache_prompt=False,
            adapter=adapter,
        )
        try:
            with GenerationClient(target) as client:
                sent = time.perf_counter()
                first = None
                for message in client.stream(request, timeout=900):
                    now = time.perf_counter()
                    if message.token_ids and first is None:
                        first = now
                    with lock:
                        arrivals.append((now, len(message.token_ids)))
                with lock:
                    starts.append(sent)
                    firsts.append(first if first is not None else now)
        except BaseException as exc:  # reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(a,)) for a in adapters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    core_cpu = (sum(cpu_ticks(pid) or 0 for pid in cores) - ticks_before) / CLK_TCK
    start, all_first = min(starts), max(firsts)
    end = max(t for t, _ in arrivals)
    total = sum(n for _, n in arrivals)
    after = sum(n for t, n in arrivals if t > all_first)
    return {
        "tokens": total,
        "tok_s": total / (end - start),
        "decode_tok_s": after / (end - all_first) if end > all_first else float("nan"),
        "tok_per_cpu_s": total / core_cpu if core_cpu > 0 else float("nan"),
        "seconds": end - start,
        "core_cpu_seconds": core_cpu,
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def core_rss(server: ServerProcess) -> int:
    roles = server_processes(server._proc.pid)  # type: ignore[union-attr]
    return sum(rss_bytes(pid) for pid in roles["core"])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument(
        "--load-format", default="auto", help="auto, or dummy:PRESET (random weights of its shape)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--no-plain",
        action="store_true",
        help="skip the server without adapters (one model in memory: a large one on one GPU)",
    )
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--keys", default=",".join(ALL_PROJECTIONS), help="modules each adapter targets"
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt ids stay below it")
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        help="OPENBLAS_NUM_THREADS of the servers (default: OpenBLAS's own, one per core); 1 "
        "keeps a shared machine's other load from stretching every BLAS call",
    )
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="DIR",
        help="another checkout whose adapter server runs beside this one's, its rounds in every "
        "replicate (the module's docstring)",
    )
    parser.add_argument(
        "--kv-cache-budget",
        default=None,
        metavar="SIZE",
        help="every server's --kv-cache-budget (default: the server's own, auto). Servers that "
        "share a GPU need one: the first's automatic budget takes the memory the next one's "
        "weights need",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/multi_lora.json")
    args = parser.parse_args()
    if args.against is not None and not (args.against / "service" / "__main__.py").is_file():
        parser.error(f"--against {args.against}: not a checkout of mlxserve (no service/)")

    names = [f"a{i}" for i in range(args.adapters)]
    # a0 a1 ... then base rows, then again from a0: 4 adapters, 8 streams -> a0-a3 base base a0 a1.
    pattern = [*names, "", ""]
    mixed = [pattern[i % len(pattern)] for i in range(args.streams)]
    layers, dims = model_dims(args.model, args.load_format)
    keys = args.keys.split(",")
    model_flags = ["--model", args.model] if args.model else []
    model_flags += ["--load-format", args.load_format, "--dtype", args.dtype]
    common = [*model_flags, "--max-batch-size", str(args.streams), "--log-format", "json"]
    if args.kv_cache_budget is not None:
        common += ["--kv-cache-budget", args.kv_cache_budget]
    if args.blas_threads is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)  # the servers inherit it
    with tempfile.TemporaryDirectory(prefix="multi-lora-") as tmp:
        flags = []
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, layers, dims, keys, args.rank, seed=i)
            flags.append(f"--adapter={name}={Path(tmp) / name}")
        with contextlib.ExitStack() as stack:
            lora = stack.enter_context(
                ServerProcess([*common, *flags], log_path=Path(tmp) / "lora.log")
            )
            plain = None
            if not args.no_plain:
                plain = stack.enter_context(ServerProcess(common, log_path=Path(tmp) / "plain.log"))
            other = None
            if args.against is not None:
                other = stack.enter_context(
                    ServerProcess(
                        [*common, *flags],
                        log_path=Path(tmp) / "against.log",
                        checkout=args.against.resolve(),
                    )
                )
            with GenerationClient(lora.target) as client:
                info = {a.name: a.memory_bytes for a in client.model_info().adapters}
            variants = {"mixed": (lora, mixed), "base": (lora, [""] * args.streams)}
            if plain is not None:
                variants["no adapters"] = (plain, [""] * args.streams)
            if other is not None:
                variants["against mixed"] = (other, mixed)
                variants["against base"] = (other, [""] * args.streams)
            for server, adapters in variants.values():  # first-use costs out of the way
                run_streams(server, adapters, args.prompt_tokens, 4, args.vocab, 0)
            rounds: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
            loads = []
            order = list(variants.items())
            for r in range(args.replicates):
                # Every other replicate runs the variants in reverse, so that a drift within a
                # replicate (the host's, or a first round's) falls on each variant alike.
                for name, (server, adapters) in order if r % 2 == 0 else order[::-1]:
                    loads.append(os.getloadavg()[0])
                    seed = 1000 * r + len(rounds[name])
                    rounds[name].append(
                        run_streams(
                            server, adapters, args.prompt_tokens, args.max_tokens, args.vocab, seed
                        )
                    )
                    done = rounds[name][-1]
                    print(
                        f"replicate {r + 1} {name}: {done['tok_s']:.0f} tok/s, "
                        f"decode {done['decode_tok_s']:.0f} tok/s",
                        flush=True,
                    )
            memory = {
                "lora_core_rss": core_rss(lora),
                "plain_core_rss": core_rss(plain) if plain is not None else 0,
            }

    def ratios(key: str, a: str, b: str) -> list[float]:
        return [x[key] / y[key] for x, y in zip(rounds[a], rounds[b])]

    def relative(key: str) -> list[float]:
        """Each replicate's mixed / base of the other tree over this one's."""
        theirs = ratios(key, "against mixed", "against base")
        return [a / b for a, b in zip(theirs, ratios(key, "mixed", "base"))]

    # Without the plain server there is nothing to subtract: say so rather than a number.
    added = memory["lora_core_rss"] - memory["plain_core_rss"] if not args.no_plain else 0
    result = {
        "git": git_state(),
        **(
            {"against": {"path": str(args.against), "git": git_state(args.against.resolve())}}
            if args.against is not None
            else {}
        ),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_1m_before_rounds": loads,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "mixed_adapters": mixed,
        "rounds": rounds,
        "summary": {
            **{f"{k} tok_s": spread([x["tok_s"] for x in v]) for k, v in rounds.items()},
            **{
                f"{k} decode_tok_s": spread([x["decode_tok_s"] for x in v])
                for k, v in rounds.items()
            },
            **{
                f"{k} tok_per_cpu_s": spread([x["tok_per_cpu_s"] for x in v])
                for k, v in rounds.items()
            },
            "mixed / base": spread(ratios("tok_s", "mixed", "base")),
            "mixed / base, decode": spread(ratios("decode_tok_s", "mixed", "base")),
            "mixed / base, per CPU s": spread(ratios("tok_per_cpu_s", "mixed", "base")),
            **(
                {
                    "base / no adapters": spread(ratios("tok_s", "base", "no adapters")),
                    "base / no adapters, per CPU s": spread(
                        ratios("tok_per_cpu_s", "base", "no adapters")
                    ),
                }
                if "no adapters" in rounds
                else {}
            ),
            **(
                {
                    "against: mixed / base": spread(
                        ratios("tok_s", "against mixed", "against base")
                    ),
                    "against: mixed / base, decode": spread(
                        ratios("decode_tok_s", "against mixed", "against base")
                    ),
                    "against / this, mixed / base": spread(relative("tok_s")),
                    "against / this, mixed / base, decode": spread(relative("decode_tok_s")),
                }
                if "against mixed" in rounds
                else {}
            ),
        },
        "memory": {
            "adapter_weights_bytes": info,
            **memory,
            "core_rss_added_bytes": None if args.no_plain else added,
            "core_rss_added_per_adapter_bytes": (
                None if args.no_plain else added / max(1, args.adapters)
            ),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))

    print_table(args, mixed, keys, layers, rounds, result, info, added)


def _range(values: dict[str, float]) -> str:
    return f"{values['min']:.1f}-{values['max']:.1f}"


def print_table(
    args: argparse.Namespace,
    mixed: list[str],
    keys: list[str],
    layers: int,
    rounds: dict[str, list[dict[str, float]]],
    result: dict[str, Any],
    info: dict[str, int],
    added: int,
) -> None:
    print(
        f"{args.streams} greedy streams, {args.prompt_tokens}-token prompts, "
        f"{args.max_tokens} tokens each; mixed: {' '.join(a or 'base' for a in mixed)}; "
        f"adapters rank {args.rank} on {len(keys)} modules x {layers} layers"
    )
    columns = (("tok_s", "tok/s"), ("decode_tok_s", "decode tok/s"), ("tok_per_cpu_s", "tok/CPU s"))
    print(f"{'variant':<14}" + "".join(f"{title:>14}{'range':>14}" for _, title in columns))
    for name, values in rounds.items():
        cells = []
        for key, _ in columns:
            s = spread([x[key] for x in values])
            cells.append(f"{s['median']:>14.1f}{_range(s):>14}")
        print(f"{name:<14}" + "".join(cells))
    for label, s in result["summary"].items():
        if "/" in label:
            print(f"{label:<38}{s['median']:.3f}  ({s['min']:.3f}-{s['max']:.3f})")
    weights = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in info.items())
    per = added / max(1, args.adapters) / 1e6
    rss = (
        "not measured (--no-plain)"
        if args.no_plain
        else f"{added / 1e6:.1f} MB ({per:.1f} MB each)"
    )
    print(f"adapter weights: {weights}; core RSS added: {rss}")
    print(f"{describe(result['git'])}; wrote {args.out}")
    if "against" in result:
        print(f"against: {result['against']['path']}, {describe(result['against']['git'])}")


def describe(git: dict[str, Any]) -> str:
    if not git:
        return "commit unknown (not a git checkout)"
    return f"commit {git['commit'][:12]}" + (" (dirty)" if git["dirty"] else "")


if __name__ == "__main__":
    main()
