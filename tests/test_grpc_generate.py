"""Generation through real gRPC on the embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import asyncio

import pytest

from mlxserve.v1 import generation_pb2 as pb
from tests.helpers.requests import chat_request, to_stream, with_id

pytestmark = [pytest.mark.slow, pytest.mark.model]

QUESTION = "What is the capital of France?"
STOP = pb.FINISH_REASON_STOP
LENGTH = pb.FINISH_REASON_LENGTH
EOS_IM_END = 2  # <|im_end|>, SmolLM2's end of turn


def france(max_tokens: int = 16, **fields) -> pb.GenerateRequest:
    return chat_request(QUESTION, max_tokens=max_tokens, **fields)


def test_greedy_chat_answers_paris(reference) -> None:
    r = reference(france())
    assert "Paris" in r.text
    assert r.finish_reason == STOP
    assert r.token_ids[-1] == EOS_IM_END
    assert r.usage.completion_tokens == len(r.token_ids)
    assert r.usage.prompt_tokens > 0
    assert r.request_id  # the server made one
    assert 0 < r.timing.time_to_first_token_seconds <= r.timing.total_seconds


def test_request_id_and_usage_are_echoed(stub) -> None:
    r = stub.Generate(france(max_tokens=2, request_id="gen-echo-1"), timeout=60)
    assert r.request_id == "gen-echo-1"
    assert r.finish_reason == LENGTH
    assert r.usage.completion_tokens == len(r.token_ids) == 2


# -- batching parity -------------------------------------------------------------------------

PARITY_REQUESTS = [
    france(),
    chat_request("Write a haiku about the ocean.", max_tokens=16),
    chat_request(
        "Explain how photosynthesis works.",
        system="You are a patient biology teacher. Answer in full sentences and give details. "
        "Your students are twelve years old, so keep the vocabulary simple.",
        max_tokens=20,
    ),
    pb.GenerateRequest(
        text="Once upon a time, in a small village",
        stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
    ),
]


async def test_batched_greedy_equals_alone(reference, aio_stub) -> None:
    """Each request inside a batch of 4 staggered requests of different lengths gives exactly
    the tokens it gives alone."""
    alone = [reference(r) for r in PARITY_REQUESTS]
    assert len({a.usage.prompt_tokens for a in alone}) == len(alone)  # all prompt lengths differ

    async def staggered(i: int, request: pb.GenerateRequest) -> pb.GenerateResponse:
        await asyncio.sleep(0.3 * i)
        return await aio_stub.Generate(with_id(request, f"parity-{i}"), timeout=120)

    async def max_active(done: asyncio.Event) -> int:
        seen = 0
        while not done.is_set():
            stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
            seen = max(seen, stats.active_sequences)
            await asyncio.sleep(0.05)
        return seen

    done = asyncio.Event()
    watcher = asyncio.ensure_future(max_active(done))
    batched = await asyncio.gather(*(staggered(i, r) for i, r in enumerate(PARITY_REQUESTS)))
    done.set()
    assert await watcher >= 3, "the requests did not overlap"
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert list(b.token_ids) == list(a.token_ids), f"request {i} differs inside the batch"
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason


# -- streaming -------------------------------------------------------------------------------


def _collect_stream(stub, request: pb.GenerateRequest) -> list[pb.StreamGenerateResponse]:
    return list(stub.StreamGenerate(to_stream(request), timeout=120))


def _check_stream(messages: list[pb.StreamGenerateResponse], unary: pb.GenerateResponse) -> None:
    assert messages, "the stream sent nothing"
    *steps, final = messages
    for m in steps:
        assert m.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        assert not m.HasField("usage") and not m.HasField("timing")
        assert len(m.token_ids) == 1, "one message per decode step"
    assert final.finish_reason == unary.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert final.HasField("usage") and final.HasField("timing")
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == list(unary.token_ids)  # same tokens, in order
    assert final.usage.completion_tokens == len(tokens)
    assert final.usage.prompt_tokens == unary.usage.prompt_tokens
    timing = final.timing
    assert 0 <= timing.queue_seconds <= timing.time_to_first_token_seconds <= timing.total_seconds
    assert "".join(m.text for m in messages) == unary.text
    assert {m.request_id for m in messages} == {messages[0].request_id}


def test_stream_matches_unary(stub, reference) -> None:
    request = france()
    messages = _collect_stream(stub, request)
    _check_stream(messages, reference(request))
    assert "Paris" in "".join(m.text for m in messages)


@pytest.mark.parametrize(
    "content",
    ['Repeat exactly: "café ☕ 日本語"', "Write the word café with three emoji"],
    ids=["cafe-coffee-japanese", "emoji"],
)
def test_logprob_bytes_join_into_the_text(stub, content: str) -> None:
    """Each logprob carries its token's bytes and their text: byte-level pieces read as what
    they stand for ("Ġthe" is " the"), and a character split over tokens is whole again once
    their bytes are joined (each piece alone reads as U+FFFD)."""
    r = stub.Generate(chat_request(content, max_tokens=10, logprobs=True), timeout=60)
    joined = b"".join(lp.bytes for lp in r.logprobs)
    assert joined.decode("utf-8") == r.text
    assert any(lp.text != lp.token for lp in r.logprobs)  # " x" spelled "Ġx"
    split = [lp for lp in r.logprobs if "\ufffd" in lp.text]
    assert split, "no character split over tokens in this answer"
    for lp in split:
        assert lp.text == lp.bytes.decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "content",
    ['Repeat exactly: "café ☕ 日本語"', "Write the word café with three emoji"],
    ids=["cafe-coffee-japanese", "emoji"],
)
def test_stream_never_splits_utf8(stub, reference, content: str) -> None:
    request = chat_request(content, max_tokens=10)
    unary = reference(request)
    assert any(ord(c) > 0x7F for c in unary.text), f"no non-ASCII output: {unary.text!r}"
    messages = _collect_stream(stub, request)
    for m in messages:
        assert "\ufffd" not in m.text, f"split character in delta {m.text!r}"
        m.text.encode("utf-8")  # valid text
    assert "\ufffd" not in unary.text
    _check_stream(messages, unary)


# -- stopping ---------------------------------------------------------------------------------


def test_stop_string_is_cut_and_never_leaks(stub, reference) -> None:
    assert "Paris" in reference(france()).text
    for stop in ("Paris", "of Fr"):  # one whole token, and text across token boundaries
        stopping = pb.StoppingCriteria(stop=["never there", stop])
        r = stub.Generate(france(stopping=stopping), timeout=60)
        assert r.finish_reason == STOP
        assert r.stop_string == stop  # which one matched
        assert stop not in r.text
        assert reference(france()).text.startswith(r.text)
    assert r.text == "The capital "
    streamed = _collect_stream(stub, france(stopping=pb.StoppingCriteria(stop=["of Fr"])))
    text = "".join(m.text for m in streamed)
    assert text == r.text
    assert streamed[-1].finish_reason == STOP
    assert streamed[-1].stop_string == "of Fr"
    assert not any(m.stop_string for m in streamed[:-1])
    # Ended by the end-of-sequence token, or by length: no stop string.
    assert reference(france()).stop_string == ""


def test_stop_token_ids(stub, reference) -> None:
    full = reference(france())
    paris = full.token_ids[list(full.token_ids).index(7042)]  # " Paris"
    r = stub.Generate(france(stopping=pb.StoppingCriteria(stop_token_ids=[paris])), timeout=60)
    assert r.finish_reason == STOP
    assert list(r.token_ids) == list(full.token_ids[: list(full.token_ids).index(paris) + 1])
    assert r.token_ids[-1] == paris
    assert "Paris" not in r.text  # kept in token_ids, not in text
    assert r.usage.completion_tokens == len(r.token_ids)


def test_max_tokens_gives_length(stub, reference) -> None:
    r = stub.Generate(france(max_tokens=3), timeout=60)
    assert r.finish_reason == LENGTH
    assert len(r.token_ids) == 3 == r.usage.completion_tokens
    assert list(r.token_ids) == list(reference(france()).token_ids[:3])


def test_ignore_eos_generates_to_max_tokens(stub, reference) -> None:
    full = reference(france())
    assert len(full.token_ids) < 12 and full.finish_reason == STOP  # stops early on its own
    r = stub.Generate(france(stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True)))
    assert r.finish_reason == LENGTH
    assert len(r.token_ids) == 12
    assert list(r.token_ids[: len(full.token_ids)]) == list(full.token_ids)


# -- sampling ---------------------------------------------------------------------------------

POEM = "Write a short poem about the sea."


def _seeded(seed: int, request_id: str = "") -> pb.GenerateRequest:
    return chat_request(
        POEM,
        max_tokens=10,
        request_id=request_id,
        sampling=pb.SamplingParams(temperature=0.8, seed=seed),
    )


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(stub, aio_stub) -> None:
    first = stub.Generate(_seeded(1234), timeout=60)
    second = stub.Generate(_seeded(1234), timeout=60)
    assert len(first.token_ids) > 0
    assert list(first.token_ids) == list(second.token_ids)

    others = [
        _seeded(4321, "seed-other-1"),
        _seeded(999, "seed-other-2"),
        chat_request("Tell me a joke.", max_tokens=10, request_id="seed-greedy"),
        chat_request(
            "Name three colors.",
            max_tokens=10,
            request_id="seed-other-params",
            sampling=pb.SamplingParams(temperature=1.2, top_p=0.9, seed=7),
        ),
    ]

    async def delayed(i: int, request: pb.GenerateRequest) -> pb.GenerateResponse:
        await asyncio.sleep(0.2 * i)
        return await aio_stub.Generate(request, timeout=120)

    batch = await asyncio.gather(
        delayed(0, others[0]),
        delayed(1, _seeded(1234, "seed-in-batch")),
        *(delayed(i + 2, r) for i, r in enumerate(others[1:])),
    )
    in_batch = batch[1]
    assert list(in_batch.token_ids) == list(first.token_ids)
    assert in_batch.text == first.text
    # Different seeds draw differently (10 sampled tokens: equal by chance is very unlikely).
    assert list(batch[0].token_ids) != list(first.token_ids)
    assert list(batch[2].token_ids) != list(first.token_ids)


def test_logit_bias_forces_a_token(stub) -> None:
    banana = 21285  # " banana"
    r = stub.Generate(
        france(max_tokens=3, sampling=pb.SamplingParams(logit_bias={banana: 100.0})), timeout=60
    )
    assert list(r.token_ids) == [banana] * 3
    assert r.text == " banana banana banana"


def test_a_generated_replacement_character_reaches_the_text(stub) -> None:
    """Token 24211 is U+FFFD itself (complete bytes EF BF BD): real text, not a split
    character, so it must not be held back forever."""
    replacement = 24211
    r = stub.Generate(
        france(max_tokens=2, sampling=pb.SamplingParams(logit_bias={replacement: 100.0})),
        timeout=60,
    )
    assert list(r.token_ids) == [replacement] * 2
    assert r.text == "\ufffd\ufffd"


def test_logprobs_and_top_logprobs(stub, reference) -> None:
    r = stub.Generate(france(max_tokens=4, logprobs=True, top_logprobs=3), timeout=60)
    assert list(r.token_ids) == list(reference(france()).token_ids[:4])
    assert len(r.logprobs) == len(r.token_ids)
    for token_id, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == token_id
        assert lp.token  # the vocabulary entry
        assert lp.text == lp.bytes.decode("utf-8")  # what it reads as
        for top in lp.top_logprobs:
            assert top.bytes and top.text == top.bytes.decode("utf-8", errors="replace")
        assert lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3
        tops = [t.logprob for t in lp.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert lp.top_logprobs[0].token_id == token_id
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-5)

    plain = stub.Generate(france(max_tokens=2), timeout=60)
    assert len(plain.logprobs) == 0  # only when asked
    only = stub.Generate(france(max_tokens=2, logprobs=True), timeout=60)
    assert len(only.logprobs) == 2 and all(len(lp.top_logprobs) == 0 for lp in only.logprobs)

    streamed = list(
        stub.StreamGenerate(to_stream(france(max_tokens=3, logprobs=True, top_logprobs=2)))
    )
    step_lps = [lp for m in streamed for lp in m.logprobs]
    assert [lp.token_id for lp in step_lps] == [t for m in streamed for t in m.token_ids]
    assert all(len(lp.top_logprobs) == 2 for lp in step_lps)


def test_penalties_count_the_tokens_generated_so_far(stub) -> None:
    """Repetition, presence and frequency penalties, greedy, beside a plain row in the batch:
    each token is the argmax of the model's logits less the penalties of the prompt's tokens and
    of every token generated before it, by the proto's definitions (computed here on the
    embedded model's own forward, in this process)."""
    import mlx.core as mx
    import numpy as np

    from service.core.models.loader import load_embedded

    prompt, steps = [1, 504, 3186, 314, 260, 3575, 282, 4649, 47, 2], 12
    sampling = pb.SamplingParams(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.5
    )
    stopping = pb.StoppingCriteria(max_tokens=steps, ignore_eos=True)
    penalized = pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=prompt), sampling=sampling, stopping=stopping
    )
    plain = pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=stopping,
    )
    futures = [stub.Generate.future(r, timeout=120) for r in (penalized, plain)]
    got, free = (list(f.result().token_ids) for f in futures)

    model = load_embedded(mx.float32).model
    tokens: list[int] = []
    for _ in range(steps):
        logits = np.array(model(mx.array([prompt + tokens]))[0, -1], dtype=np.float64)
        seen = sorted(set(prompt) | set(tokens))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / 1.3, logits[seen] * 1.3)
        for token in set(tokens):
            logits[token] -= 0.5 + 1.5 * tokens.count(token)
        tokens.append(int(np.argmax(logits)))
    assert got == tokens
    assert got != free  # the penalties changed the answer
