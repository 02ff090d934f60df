"""service.core.models.lora against mlx-lm: adapters trained here by mlx-lm's own trainer on tiny
seeded llamas (float32, a 4-bit copy, a copy with biases), installed together on one model and
stepped as mlx-lm's generate_step steps (prefill prompt[:-1], then one token at a time)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from service.core.models import lora, projections
from tests.helpers import adapters as trained
from tests.helpers.adapters import SPECS, TOLERANT, ULPS, mlx_lm_generate, prompts

pytestmark = pytest.mark.slow  # builds checkpoints and trains adapters

STEPS = 8


@pytest.fixture(scope="module")
def work(tiny_adapters: Path) -> Path:
    """The session's tiny bases and adapters (conftest.tiny_adapters)."""
    return tiny_adapters


def served(
    work: Path,
    base: str,
    names: tuple[str, ...] | None = None,
    kernel: bool = False,
    fused: bool = False,
):
    """The base model with its adapters (or `names`) installed in one AdapterSet; `fused`: over
    sibling projections made one matmul first, as the server does on CUDA."""
    from mlx_lm import load

    model, _ = load(str(work / base))
    if fused:
        assert projections.fuse(model) > 0
    aset = lora.AdapterSet(model, kernel=kernel)
    for name in names or [n for n, s in SPECS.items() if s.base == base]:
        aset.add(lora.load_adapter(name, work / "adapters" / name, model))
    return model, aset


def slots_of(aset: lora.AdapterSet, names: list[str | None]) -> lora.RowAdapters | None:
    return aset.rows(np.asarray([aset.slot(n) if n else 0 for n in names], np.int32))


def generate(model, batch: list[list[int]], rows: lora.RowAdapters | None):
    """Greedy over a batch of equal-length prompts, each row with its adapter."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array(batch)
    cache = make_prompt_cache(model)
    out, lps = [], []
    with lora.use_adapters(rows):
        model(tokens[:, :-1], cache=cache)
        y = tokens[:, -1:]
        for _ in range(STEPS):
            logits = model(y, cache=cache)[:, -1, :]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            y = mx.argmax(lp, axis=-1)[:, None]
            mx.eval(y, lp)
            out.append(y[:, 0])
            lps.append(lp)
    return mx.stack(out, axis=1).tolist(), mx.stack(lps, axis=1)


@pytest.mark.parametrize("base", ["f", "q", "b"])
def test_each_adapter_alone_is_mlx_lm(work: Path, base: str) -> None:
    """Greedy tokens and every logprob as mlx-lm computes them with the adapter loaded: the
    tokens exactly, the logprobs to a few ulps for LoRA (float, quantized, biased bases) and DoRA
    on a float base (bit-identical where the CPU's BLAS rounds alike across shapes)."""
    model, aset = served(work, base)
    prompt = prompts(1, seed=7)
    base_ref = mlx_lm_generate(work / base, None, prompt[0], STEPS)
    for name in aset.names:
        ref = mlx_lm_generate(work / base, work / "adapters" / name, prompt[0], STEPS)
        assert ref.tokens != base_ref.tokens, f"{name} does not change greedy output"
        tokens, lp = generate(model, prompt, slots_of(aset, [name]))
        assert tokens[0] == ref.tokens, name
        diff = mx.abs(lp[0] - ref.logprobs).max().item()
        assert diff < (1e-4 if name in TOLERANT else ULPS), (name, diff)
    # Base rows through the installed wrappers: plain mlx-lm, bit for bit.
    tokens, lp = generate(model, prompt, None)
    assert tokens[0] == base_ref.tokens and mx.array_equal(lp[0], base_ref.logprobs)
    zero = lora.RowAdapters(mx.array([lora.NO_ADAPTER], dtype=mx.int32))
    assert mx.array_equal(generate(model, prompt, zero)[1], lp)


@pytest.mark.parametrize("base", ["f", "q", "b"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(work: Path, base: str) -> None:
    """Every adapter and the base model, twice, in one batch: each row's tokens are its own
    alone; and a row's numbers do not depend on the other rows' adapters (the same batch with
    every row on this row's adapter gives it to a few ulps: bit for bit where the CPU's BLAS
    rounds alike across the shapes of the adapters' row groups)."""
    model, aset = served(work, base)
    names: list[str | None] = [*aset.names, None] * 2
    batch = prompts(len(names), seed=11)
    tokens, lp = generate(model, batch, slots_of(aset, names))
    for i, name in enumerate(names):
        alone_tokens, alone_lp = generate(model, batch[i : i + 1], slots_of(aset, [name]))
        assert tokens[i] == alone_tokens[0], (i, name)
        # The base product's rounding depends on the batch's rows (as without adapters).
        assert mx.abs(lp[i] - alone_lp[0]).max().item() < 1e-4
        _, same = generate(model, batch, slots_of(aset, [name] * len(names)))
        assert mx.abs(lp[i] - same[i]).max().item() < ULPS, (i, name)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("base", ["f", "q", "b"])
def test_the_kernel_path_gives_mlx_lm_numbers_in_a_mixed_batch(
    work: Path, base: str, fused: bool
) -> None:
    """The CUDA path (EngineConfig.lora_kernel; on the CPU its MLX-op reference): each row of a
    batch mixing every adapter (ranks 4 to 16, DoRA layers taking the gathered path) and the
    base has mlx-lm's greedy tokens with its adapter, and its logprobs to float tolerance; also
    over fused sibling projections (EngineConfig.fused_projections), whose groups hold on."""
    names_of = {"f": ("all7", "qv_head", "dora_mlp"), "q": None, "b": None}
    model, aset = served(work, base, names_of[base], kernel=True, fused=fused)
    assert all(w.kernel for w in aset.wrappers.values())
    names: list[str | None] = [*aset.names, None]
    batch = prompts(len(names), seed=11)
    tokens, lp = generate(model, batch, slots_of(aset, names))
    for i, name in enumerate(names):
        adapter = None if name is None else work / "adapters" / name
        ref = mlx_lm_generate(work / base, adapter, batch[i], STEPS)
        assert tokens[i] == ref.tokens, (i, name)
        # The base product's rounding depends on the batch's rows (as without adapters).
        assert mx.abs(lp[i] - ref.logprobs).max().item() < 1e-4, (i, name)
    assert all(g.enabled for g in projections.groups(model))


def test_adapters_of_several_ranks_share_layers_exactly(work: Path) -> None:
    """Ranks 4, 8 and 16 stacked in the same layers (padded to 16): each adapter's rows are
    still mlx-lm's in prefill (per-rank products) and decode (padded): its tokens, and its
    logprobs to a few ulps."""
    model, aset = served(work, "f", ("all7", "qv_head", "dora_mlp"))
    assert any(w._stack is not None and w._stack.by_rank for w in aset.wrappers.values())
    prompt = prompts(1, seed=7)
    for name in aset.names:
        ref = mlx_lm_generate(work / "f", work / "adapters" / name, prompt[0], STEPS)
        tokens, lp = generate(model, prompt, slots_of(aset, [name]))
        assert tokens[0] == ref.tokens, name
        assert mx.abs(lp[0] - ref.logprobs).max().item() < ULPS, name


def test_bfloat16_base_with_float32_adapters_is_mlx_lm(work: Path, tmp_path: Path) -> None:
    """The trainer saves float32 adapters; on a bfloat16 base the low-rank products run in
    float32 and are cast once, as in mlx-lm."""
    import shutil

    half = tmp_path / "half"
    half.mkdir()
    weights = mx.load(str(work / "f" / "model.safetensors"))
    mx.save_safetensors(
        str(half / "model.safetensors"),
        {k: v.astype(mx.bfloat16) for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "f" / f, half / f)
    from mlx_lm import load

    model, _ = load(str(half))
    aset = lora.AdapterSet(model)
    for name in ("all7", "dora_mlp"):
        aset.add(lora.load_adapter(name, work / "adapters" / name, model))
    prompt = prompts(1, seed=7)
    for name in aset.names:
        ref = mlx_lm_generate(half, work / "adapters" / name, prompt[0], STEPS)
        tokens, lp = generate(model, prompt, slots_of(aset, [name]))
        assert lp.dtype == mx.bfloat16
        assert tokens[0] == ref.tokens and mx.array_equal(lp[0], ref.logprobs), name


def test_rows_given_flat_take_their_adapters(work: Path) -> None:
    """The LM head sees [rows, H]: each row's update is the one it gets as [rows, 1, H]."""
    model, aset = served(work, "f")
    head = aset.wrappers["lm_head"]
    x = mx.random.normal((3, 64))
    rows = slots_of(aset, ["qv_head", None, "qv_head"])
    with lora.use_adapters(rows):
        flat, batched = head(x), head(x[:, None, :])[:, 0, :]
    assert mx.array_equal(flat, batched)
    assert mx.array_equal(flat[1], model.lm_head.linear(x)[1])
    assert not mx.array_equal(flat[0], model.lm_head.linear(x)[0])


def test_a_compiled_forward_takes_the_slots_as_an_input(work: Path) -> None:
    """Set inside a traced function from one of its inputs, the rows' slots are not frozen
    into the graph: the same compiled function serves other slots."""
    model, aset = served(work, "f")
    tokens = mx.array(prompts(2, seed=3))

    def forward(tokens: mx.array, slots: mx.array) -> mx.array:
        with lora.use_adapters(lora.RowAdapters(slots)):
            return model(tokens)

    compiled = mx.compile(forward)
    for names in (["all7", None], [None, "qv_head"], ["dora_mlp", "all7"]):
        rows = slots_of(aset, names)
        assert rows is not None
        eager = forward(tokens, rows.slots)
        assert mx.allclose(compiled(tokens, rows.slots), eager, atol=1e-5), names


def test_remove_frees_the_slot_for_the_next_adapter(work: Path) -> None:
    model, aset = served(work, "f")
    prompt = prompts(1, seed=3)
    before = generate(model, prompt, slots_of(aset, ["qv_head"]))
    slot = aset.remove("qv_head")
    freed = lora.RowAdapters(mx.array([slot], dtype=mx.int32))
    assert mx.array_equal(generate(model, prompt, freed)[1], generate(model, prompt, None)[1])
    assert aset.add(lora.load_adapter("qv_head", work / "adapters" / "qv_head", model)) == slot
    after = generate(model, prompt, slots_of(aset, ["qv_head"]))
    # The stack was rebuilt in between, its shapes with it: the same tokens, a few ulps at most.
    assert before[0] == after[0] and mx.abs(before[1] - after[1]).max().item() < ULPS
    aset.uninstall()
    assert not any(isinstance(m, lora.MultiLoRALinear) for _, m in model.named_modules())


def test_memory_is_the_adapters_weights(work: Path) -> None:
    _, aset = served(work, "f", ("all7",))
    info = aset.describe("all7")
    # 7 projections in 2 layers: q/o 64->64, k/v 64->32, gate/up 64->128, down 128->64.
    shapes = 2 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 2 + (128 + 64))
    assert info.memory_bytes == shapes * 8 * 4
    # The stacks also hold the zero slot.
    assert aset.memory_bytes() >= 2 * info.memory_bytes
    assert info.rank == 8 and info.num_layers == 2
    assert "self_attn.q_proj" in info.target_modules and info.fine_tune_type == "lora"
    assert info.scale == 20.0


# -- refusals ---------------------------------------------------------------------------------


def refused(model, path: Path, *fragments: str) -> str:
    with pytest.raises(lora.AdapterError) as caught:
        lora.load_adapter("x", path, model)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_what_cannot_be_served_is_refused_with_the_reason(work: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    model, _ = load(str(work / "f"))
    src = work / "adapters"
    copy = trained.copy_adapter

    def config(name: str, dst: str, edit) -> Path:
        return copy(src / name, tmp_path / dst, config_edit=edit)

    def weights(name: str, dst: str, edit) -> Path:
        return copy(src / name, tmp_path / dst, weights_edit=edit)

    refused(model, config("all7", "full", lambda c: c.update(fine_tune_type="full")), "full")
    refused(
        model,
        config("all7", "emb", lambda c: c["lora_parameters"].update(keys=["model.embed_tokens"])),
        "model.embed_tokens",
        "embeddings",
    )
    refused(model, config("all7", "noscale", lambda c: c["lora_parameters"].pop("scale")), "scale")
    refused(
        model,
        config("all7", "rank", lambda c: c["lora_parameters"].update(rank=4)),
        "does not match",
    )
    refused(
        model,
        config("all7", "nothing", lambda c: c["lora_parameters"].update(keys=["no.such"])),
        "match no module",
    )
    refused(
        model,
        weights(
            "qv_head",
            "extra",
            lambda w: w.update({"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((64, 4))}),
        ),
        "model.layers.0.self_attn.q_proj.lora_a: not a lora parameter",
    )
    refused(
        model,
        weights("qv_head", "missing", lambda w: w.pop("model.layers.1.self_attn.v_proj.lora_b")),
        "model.layers.1.self_attn.v_proj.lora_b: missing",
    )
    refused(
        model,
        weights("dora_mlp", "nom", lambda w: w.pop("model.layers.0.mlp.up_proj.m")),
        "model.layers.0.mlp.up_proj.m: missing",
    )
    refused(model, tmp_path / "nope", "adapter_config.json not found")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{")
    (tmp_path / "bad" / "adapters.safetensors").write_text("")
    refused(model, tmp_path / "bad", "unreadable adapter_config.json")


def test_an_adapter_of_another_base_is_refused(work: Path, tmp_path: Path) -> None:
    """Trained on a wider model (shapes named), or on a deeper one (module names it lacks)."""
    from mlx_lm import load

    model, _ = load(str(work / "f"))
    data = trained.dataset(tmp_path / "data", seed=1)
    settings = {"num_layers": -1, "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}}
    wide = trained.build_base(tmp_path / "wide", trained.TINY_LLAMA | {"hidden_size": 96})
    refused(
        model,
        trained.train(wide, data, tmp_path / "wide_adapter", settings, iters=1),
        "model.layers.0.mlp.gate_proj.lora_a: adapter shape (96, 4) does not match (64, 4)",
    )
    deep = trained.build_base(tmp_path / "deep", trained.TINY_LLAMA | {"num_hidden_layers": 3})
    refused(
        model,
        trained.train(deep, data, tmp_path / "deep_adapter", settings | {"num_layers": 1}, iters=1),
        "model.layers.2.",
    )


def test_lora_on_moe_experts_is_refused(tmp_path: Path) -> None:
    from mlx_lm.models import mixtral

    model = mixtral.Model(
        mixtral.ModelArgs.from_dict(
            {
                "model_type": "mixtral",
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "vocab_size": 64,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1e4,
            }
        )
    )
    config = {
        "fine_tune_type": "lora",
        "num_layers": -1,
        "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0},
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "adapters.safetensors"), {"x": mx.zeros((1,))})
    refused(model, tmp_path, "switch_mlp", "MoE experts")
    # Attention alone on the same model is fine to target (then checked).
    config["lora_parameters"]["keys"] = ["self_attn.q_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    refused(model, tmp_path, "q_proj.lora_a: missing")


def test_a_name_is_loaded_once(work: Path) -> None:
    model, aset = served(work, "f", ("all7",))
    with pytest.raises(lora.AdapterError, match="already loaded"):
        aset.add(lora.load_adapter("all7", work / "adapters" / "all7", model))
