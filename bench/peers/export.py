"""The weights our server serves, written once as an mlx-lm model directory for the peers.

`mlx_lm.server --model DIR` needs config.json, *.safetensors and tokenizer files. The directory
is made from exactly what our loader builds (`service.core.models.loader.load_model`): the embedded
GGUF dequantized to the serving dtype with Hugging Face tensor names, or a dummy preset's random
weights (fixed seed), plus the embedded tokenizer with its chat template. It is cached under
`.cache/` (gitignored) and reused; a model directory given with --model is used as it is.

Run as `python -m bench.peers.export --out DIR [--load-format F] [--dtype D]` in its own process
(it imports MLX); `ensure_model_dir` does that for the harness.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench.peers import REPO_ROOT, mlx_env

DEFAULT_CACHE = REPO_ROOT / ".cache"
_DONE = "mlxserve-export.json"


def cache_dir_for(load_format: str, dtype: str, root: Path = DEFAULT_CACHE) -> Path:
    if load_format.startswith("dummy"):
        preset = load_format.partition(":")[2] or "smollm2-135m"
        return root / f"mlx-lm-dummy-{preset}-{dtype}"
    return root / f"mlx-lm-smollm2-{dtype}"


def ensure_model_dir(
    *,
    model: str | None,
    load_format: str,
    dtype: str,
    progress: Callable[[str], None],
    cache_root: Path = DEFAULT_CACHE,
) -> Path:
    """The mlx-lm directory holding the weights our server serves for these options."""
    if model and model != "embedded" and not load_format.startswith("dummy"):
        return Path(model)
    out = cache_dir_for(load_format, dtype, cache_root)
    if (out / _DONE).exists():
        progress(f"peer weights: reusing {out}")
        return out
    progress(f"peer weights: exporting {load_format} ({dtype}) to {out}")
    command = [
        sys.executable,
        "-m",
        "bench.peers.export",
        "--out",
        str(out),
        "--load-format",
        load_format,
        "--dtype",
        dtype,
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, env=mlx_env(), check=False)
    if done.returncode != 0 or not (out / _DONE).exists():
        raise RuntimeError(f"exporting the peer's weights failed (exit {done.returncode})")
    return out


def export(out: Path, load_format: str, dtype_name: str) -> dict:
    import dataclasses

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from service.core.models.loader import load_model

    loaded = load_model(None, dtype_name, load_format)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    # A preset's config.json as it is (its quantization block included: mlx-lm quantizes the
    # modules whose scales the weights carry); the GGUF's llama arguments otherwise.
    config = dict(loaded.config or {**dataclasses.asdict(loaded.model.args), "model_type": "llama"})
    config["eos_token_id"] = sorted(loaded.tokenizer.eos_token_ids)
    config["torch_dtype"] = str(loaded.dtype).rsplit(".", 1)[-1]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    loaded.tokenizer._hf.save_pretrained(str(tmp))
    info = {
        "load_format": load_format,
        "dtype": config["torch_dtype"],
        "model_id": loaded.model_id,
        "parameters": sum(v.size for v in weights.values()),
        "tensors": len(weights),
    }
    (tmp / _DONE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # complete or absent: an interrupted export is never reused
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    info = export(args.out, args.load_format, args.dtype)
    print(f"exported {info} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
