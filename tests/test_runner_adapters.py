"""The model runner with LoRA adapters, driven through step plans (tests/helpers/tiny.Driven):
rows of several adapters and none share prefill, decode and verification forwards, each with
mlx-lm's tokens for its adapter; adapters are loaded between steps and cleared by a plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.common.model_source import ModelLoadError
from service.core.models import lora
from service.protocol import SamplingParams
from tests.helpers import adapters as trained
from tests.helpers.adapters import mlx_lm_generate
from tests.helpers.tiny import DraftRow, Driven, StepRow, make_engine, paged

pytestmark = pytest.mark.slow  # builds checkpoints and trains adapters

STEPS = 8
NAMES = ("all7", "qv_head", "dora_mlp")


@pytest.fixture(scope="module")
def work(tiny_adapters: Path) -> Path:
    """The session's tiny bases and adapters (conftest.tiny_adapters)."""
    return tiny_adapters


def engine(
    work: Path, names: tuple[str, ...] = NAMES, base: str = "f"
) -> tuple[Driven, lora.AdapterSet]:
    from mlx_lm import load

    model, _ = load(str(work / base))
    aset = lora.AdapterSet(model)
    for name in names:
        aset.add(lora.load_adapter(name, work / "adapters" / name, model))
    return make_engine(model, paged(num_blocks=128), adapters=aset), aset


def generate(driven: Driven, aset: lora.AdapterSet, rows: list[tuple[str | None, list[int]]]):
    """Greedy rows in one batch (each with its adapter): the tokens and logprobs of each."""
    seqs = [
        driven.add_sequence(
            f"r{i}",
            SamplingParams(),
            prompt,
            want_logprobs=True,
            adapter=aset.slot(name) if name else 0,
        )
        for i, (name, prompt) in enumerate(rows)
    ]
    first = driven.prefill([StepRow(s, p) for s, (_, p) in zip(seqs, rows)])
    tokens = [[r.token_id] for r in first]
    logprobs = [[r.logprob] for r in first]
    for _ in range(STEPS - 1):
        for i, r in enumerate(driven.step([StepRow(s) for s in seqs])):
            tokens[i].append(r.token_id)
            logprobs[i].append(r.logprob)
    for s in seqs:
        driven.release(s)
    return tokens, logprobs


def test_a_batch_of_several_adapters_and_none_gives_each_row_mlx_lms_tokens(work: Path) -> None:
    """Prompts of different lengths, every adapter and the base twice, in one batch: each row
    gets mlx-lm's greedy tokens for its adapter, its logprobs to float tolerance, and what it
    gets alone on the same engine."""
    driven, aset = engine(work)
    names: list[str | None] = [*NAMES, None] * 2
    prompts = [trained.prompts(1, seed=20 + i, length=5 + 3 * i)[0] for i in range(len(names))]
    tokens, logprobs = generate(driven, aset, list(zip(names, prompts)))
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        adapter = work / "adapters" / name if name else None
        ref = mlx_lm_generate(work / "f", adapter, prompt, STEPS)
        assert tokens[i] == ref.tokens, (i, name)
        want = [float(ref.logprobs[j, t].item()) for j, t in enumerate(ref.tokens)]
        assert np.allclose(logprobs[i], want, atol=1e-4), (i, name)
        alone, _ = generate(driven, aset, [(name, prompt)])
        assert alone[0] == tokens[i], (i, name)


@pytest.mark.parametrize("base", ["q", "b"])
def test_quantized_and_biased_bases_with_lora_and_dora(work: Path, base: str) -> None:
    """QLoRA and DoRA on a 4-bit base, LoRA and DoRA on a base with biases, batched with the
    base model: mlx-lm's tokens for each, logprobs to float tolerance."""
    names = tuple(n for n, spec in trained.SPECS.items() if spec.base == base)
    driven, aset = engine(work, names, base)
    rows: list[tuple[str | None, list[int]]] = [
        (name, trained.prompts(1, seed=70 + i, length=6 + 2 * i)[0])
        for i, name in enumerate([*names, None])
    ]
    tokens, logprobs = generate(driven, aset, rows)
    for (name, prompt), got, lps in zip(rows, tokens, logprobs):
        ref = mlx_lm_generate(
            work / base, work / "adapters" / name if name else None, prompt, STEPS
        )
        assert got == ref.tokens, name
        want = [float(ref.logprobs[j, t].item()) for j, t in enumerate(ref.tokens)]
        assert np.allclose(lps, want, atol=1e-4), name


def test_verification_scores_each_rows_drafts_with_its_adapter(work: Path) -> None:
    """Drafts that are each row's own continuation (under its adapter, or none) are all
    accepted in one verification forward; a wrong draft is rejected at once, and the token the
    row emits instead is its adapter's."""
    driven, aset = engine(work)
    prompt = trained.prompts(1, seed=5, length=9)[0]
    rows = []
    for name in ("all7", "qv_head", None):
        ref = mlx_lm_generate(work / "f", work / "adapters" / name if name else None, prompt)
        slot = aset.slot(name) if name else 0
        seq = driven.add_sequence(name or "base", SamplingParams(), prompt, adapter=slot)
        assert driven.prefill([StepRow(seq, prompt)])[0].token_id == ref.tokens[0]
        rows.append((seq, ref.tokens))
    verified = driven.verify([DraftRow(seq, ref[0], ref[1:5]) for seq, ref in rows])
    for (_, ref), v in zip(rows, verified):
        assert v.accepted == 4 and [r.token_id for r in v.results] == ref[1:6]
    seq, ref = rows[0]
    wrong = (ref[6] + 1) % trained.VOCAB
    (v,) = driven.verify([DraftRow(seq, ref[5], [wrong, wrong])])
    assert v.accepted == 0 and [r.token_id for r in v.results] == [ref[6]]


def test_an_adapter_loaded_between_steps_serves_the_next_rows(work: Path) -> None:
    driven, aset = engine(work, ("all7",))
    runner = driven.engine
    description = runner.load_adapter("qv_head", str(work / "adapters" / "qv_head"), 2)
    assert description.name == "qv_head" and description.rank == 4
    prompt = trained.prompts(1, seed=9)[0]
    tokens, _ = generate(driven, aset, [("qv_head", prompt), ("all7", prompt)])
    for name, got in zip(("qv_head", "all7"), tokens):
        assert got == mlx_lm_generate(work / "f", work / "adapters" / name, prompt, STEPS).tokens
    with pytest.raises(ModelLoadError, match=r"adapter_config\.json not found"):
        runner.load_adapter("bad", str(work), 3)


def test_an_unload_plan_clears_the_slot_once_no_row_uses_it(work: Path) -> None:
    driven, aset = engine(work, ("all7", "qv_head"))
    prompt = trained.prompts(1, seed=4)[0]
    slot = aset.slot("qv_head")
    seq = driven.add_sequence("a", SamplingParams(), prompt, adapter=slot)
    with pytest.raises(ValueError, match="while a row uses it"):
        driven.unload_adapter(slot)
    driven.release(seq)
    driven.unload_adapter(slot)
    assert aset.names == ["all7"]
    with pytest.raises(ValueError, match=f"adapter slot {slot} holds no adapter"):
        driven.add_sequence("b", SamplingParams(), prompt, adapter=slot)
