"""service/frontend/validation.py on a fake tokenizer: every bad field is named, good input is
kept."""

from __future__ import annotations

import math

import pytest

from mlxserve.v1 import generation_pb2 as pb
from service.common.tokenizer import ChatTurn
from service.frontend.validation import (
    InvalidRequestError,
    PromptTooLongError,
    generation_request,
    prompt_token_ids,
    sampling_params,
)
from service.protocol import ResponseFormat

VOCAB = 100


class FakeTokenizer:
    vocab_size = VOCAB
    max_token_chars = 1  # one token per character

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def render_chat(
        self, turns: list[ChatTurn], *, allow_special_tokens: bool = False
    ) -> list[int]:
        # A leading 5 marks a chat rendered with special tokens parsed in its content.
        head = [5] if allow_special_tokens else []
        return [*head, 1, *(t for turn in turns for t in [2, *self.encode(turn.content), 3]), 4]


TOK = FakeTokenizer()


def _validate(
    message: pb.GenerateRequest | pb.StreamGenerateRequest,
    slot_context: int = 64,
    default_max_tokens: int = 16,
    prompt_cache_enabled: bool = True,
):
    return generation_request(
        message,
        TOK,
        slot_context=slot_context,
        default_max_tokens=default_max_tokens,
        prompt_cache_enabled=prompt_cache_enabled,
    )


def _text(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello", **fields)


# -- good input --------------------------------------------------------------------------------


def test_defaults() -> None:
    req = _validate(_text())
    assert req.prompt_token_ids == tuple(TOK.encode("hello"))
    assert len(req.request_id) >= 16  # the server makes one
    assert req.max_tokens == 16  # the server default
    assert req.sampling.greedy and req.sampling.top_p == 1.0 and req.sampling.seed is None
    assert req.stop == () and req.stop_token_ids == frozenset() and not req.ignore_eos
    assert req.priority == 0 and not req.logprobs and req.top_logprobs == 0
    assert req.cache_prompt


def test_request_ids_are_unique_when_made_by_the_server() -> None:
    assert _validate(_text()).request_id != _validate(_text()).request_id


def test_every_field_is_carried() -> None:
    message = pb.GenerateRequest(
        request_id="abc",
        token_ids=pb.TokenIdsInput(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=42,
            logit_bias={9: 2.5, 3: -1.0},
        ),
        stopping=pb.StoppingCriteria(
            max_tokens=20, stop=["\n\n", "END"], stop_token_ids=[8, 9], ignore_eos=True
        ),
        priority=-3,
        logprobs=True,
        top_logprobs=5,
        cache_prompt=False,
    )
    req = _validate(message)
    assert req.request_id == "abc"
    assert req.prompt_token_ids == (5, 6, 7)
    s = req.sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert s.top_k == 40 and s.min_p == pytest.approx(0.05)
    assert s.repetition_penalty == pytest.approx(1.1)
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.5
    assert s.seed == 42
    assert s.logit_bias == ((3, -1.0), (9, 2.5))
    assert req.max_tokens == 20 and req.stop == ("\n\n", "END")
    assert req.stop_token_ids == frozenset({8, 9}) and req.ignore_eos
    assert req.priority == -3 and req.logprobs and req.top_logprobs == 5
    assert not req.cache_prompt


def test_stream_request_validates_the_same() -> None:
    message = pb.StreamGenerateRequest(
        text="hello", stopping=pb.StoppingCriteria(max_tokens=3), priority=2
    )
    req = _validate(message)
    assert req.max_tokens == 3 and req.priority == 2


def test_chat_is_rendered_with_the_template() -> None:
    message = pb.GenerateRequest(
        chat=pb.ChatInput(
            messages=[
                pb.ChatMessage(role="system", content="s"),
                pb.ChatMessage(role="user", content="u"),
                pb.ChatMessage(role="assistant", content="a"),
                pb.ChatMessage(role="tool", content="t"),
            ]
        )
    )
    expected = TOK.render_chat([ChatTurn(r, r[0]) for r in ("system", "user", "assistant", "tool")])
    assert prompt_token_ids(message, TOK, slot_context=64) == expected


def test_special_tokens_in_content_are_parsed_only_when_allowed() -> None:
    """Content is rendered with special tokens as plain text unless the flag says otherwise,
    for Generate and Tokenize alike."""
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="u")])
    for message in (pb.GenerateRequest(chat=chat), pb.TokenizeRequest(chat=chat)):
        assert prompt_token_ids(message, TOK, slot_context=64)[0] == 1
        allowed = prompt_token_ids(
            message, TOK, slot_context=64, allow_special_tokens_in_content=True
        )
        assert allowed[0] == 5
    request = generation_request(
        pb.GenerateRequest(chat=chat),
        TOK,
        slot_context=64,
        default_max_tokens=4,
        prompt_cache_enabled=True,
        allow_special_tokens_in_content=True,
    )
    assert request.prompt_token_ids[0] == 5


def test_explicit_zero_sampling_values_are_not_unset() -> None:
    s = sampling_params(pb.SamplingParams(temperature=0.0, top_k=0, min_p=0.0), VOCAB)
    assert s.greedy and s.top_k == 0 and s.min_p == 0.0
    # Unset fields take the defaults, not zero.
    assert sampling_params(pb.SamplingParams(), VOCAB).repetition_penalty == 1.0
    assert sampling_params(pb.SamplingParams(), VOCAB).top_p == 1.0


def test_boundaries_are_accepted() -> None:
    s = sampling_params(
        pb.SamplingParams(
            temperature=100, top_p=1.0, min_p=1.0, repetition_penalty=10,
            presence_penalty=-2, frequency_penalty=2, logit_bias={VOCAB - 1: -100.0, 0: 100.0},
        ),
        VOCAB,
    )  # fmt: skip
    assert s.temperature == 100 and s.top_p == 1.0 and s.min_p == 1.0
    _validate(_text(logprobs=True, top_logprobs=20))
    _validate(pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[0, VOCAB - 1])))


def test_huge_seed_is_folded_into_63_bits() -> None:
    s = sampling_params(pb.SamplingParams(temperature=1.0, seed=2**64 - 1), VOCAB)
    assert s.seed == 2**63 - 1


def test_max_tokens_is_capped_to_the_room_left_in_the_slot() -> None:
    prompt = pb.TokenIdsInput(ids=[1] * 60)
    stopping = pb.StoppingCriteria(max_tokens=50)
    req = _validate(pb.GenerateRequest(token_ids=prompt, stopping=stopping))
    assert req.max_tokens == 4
    assert _validate(pb.GenerateRequest(token_ids=prompt)).max_tokens == 4  # default capped too


def test_prompt_cache_switch_follows_the_server() -> None:
    assert not _validate(_text(cache_prompt=True), prompt_cache_enabled=False).cache_prompt
    assert _validate(_text(cache_prompt=True)).cache_prompt


# -- bad input ---------------------------------------------------------------------------------

BAD = {
    "no-input": (pb.GenerateRequest(), "input"),
    "empty-text": (pb.GenerateRequest(text=""), "text"),
    "empty-token-ids": (pb.GenerateRequest(token_ids=pb.TokenIdsInput()), "token_ids.ids"),
    "token-id-outside-vocab": (
        pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1, VOCAB])),
        "token_ids.ids[1]",
    ),
    "empty-chat": (pb.GenerateRequest(chat=pb.ChatInput()), "chat.messages"),
    "unknown-role": (
        pb.GenerateRequest(
            chat=pb.ChatInput(
                messages=[
                    pb.ChatMessage(role="user", content="a"),
                    pb.ChatMessage(role="robot", content="b"),
                ]
            )
        ),
        "chat.messages[1].role",
    ),
    "empty-role": (
        pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(content="a")])),
        "chat.messages[0].role",
    ),
    "temperature-negative": (
        _text(sampling=pb.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    "temperature-too-high": (
        _text(sampling=pb.SamplingParams(temperature=101)),
        "sampling.temperature",
    ),
    "temperature-nan": (
        _text(sampling=pb.SamplingParams(temperature=math.nan)),
        "sampling.temperature",
    ),
    "top-p-zero": (_text(sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    "top-p-above-one": (_text(sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    "top-k-negative": (_text(sampling=pb.SamplingParams(top_k=-1)), "sampling.top_k"),
    "min-p-negative": (_text(sampling=pb.SamplingParams(min_p=-0.1)), "sampling.min_p"),
    "min-p-above-one": (_text(sampling=pb.SamplingParams(min_p=1.1)), "sampling.min_p"),
    "repetition-penalty-zero": (
        _text(sampling=pb.SamplingParams(repetition_penalty=0)),
        "sampling.repetition_penalty",
    ),
    "repetition-penalty-too-high": (
        _text(sampling=pb.SamplingParams(repetition_penalty=11)),
        "sampling.repetition_penalty",
    ),
    "presence-penalty": (
        _text(sampling=pb.SamplingParams(presence_penalty=3)),
        "sampling.presence_penalty",
    ),
    "frequency-penalty": (
        _text(sampling=pb.SamplingParams(frequency_penalty=-2.5)),
        "sampling.frequency_penalty",
    ),
    "logit-bias-key": (
        _text(sampling=pb.SamplingParams(logit_bias={VOCAB: 1.0})),
        f"sampling.logit_bias[{VOCAB}]",
    ),
    "logit-bias-value": (
        _text(sampling=pb.SamplingParams(logit_bias={5: 101.0})),
        "sampling.logit_bias[5]",
    ),
    "logit-bias-nan": (
        _text(sampling=pb.SamplingParams(logit_bias={5: math.nan})),
        "sampling.logit_bias[5]",
    ),
    "max-tokens-zero": (_text(stopping=pb.StoppingCriteria(max_tokens=0)), "stopping.max_tokens"),
    "empty-stop-string": (
        _text(stopping=pb.StoppingCriteria(stop=["ok", ""])),
        "stopping.stop[1]",
    ),
    "too-many-stop-strings": (
        _text(stopping=pb.StoppingCriteria(stop=[f"s{i}" for i in range(17)])),
        "stopping.stop",
    ),
    "stop-token-outside-vocab": (
        _text(stopping=pb.StoppingCriteria(stop_token_ids=[7, VOCAB])),
        "stopping.stop_token_ids[1]",
    ),
    "top-logprobs-without-logprobs": (_text(top_logprobs=2), "top_logprobs"),
    "top-logprobs-too-many": (_text(logprobs=True, top_logprobs=21), "top_logprobs"),
    "request-id-too-long": (_text(request_id="x" * 129), "request_id"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_field(case) -> None:
    """The error carries the field's path (the BadRequest field violation) and its message
    names the field."""
    message, field = case
    with pytest.raises(InvalidRequestError) as info:
        _validate(message)
    assert info.value.field == field
    assert field.split("[")[0] in str(info.value)


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_stream_input_names_the_field(case) -> None:
    message, field = case
    stream = pb.StreamGenerateRequest.FromString(message.SerializeToString())
    with pytest.raises(InvalidRequestError) as info:
        _validate(stream)
    assert info.value.field == field


@pytest.mark.parametrize("length", [64, 65, 1000])
def test_prompt_longer_than_the_slot(length: int) -> None:
    message = pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1] * length))
    with pytest.raises(PromptTooLongError) as info:
        _validate(message, slot_context=64)
    assert isinstance(info.value, InvalidRequestError)
    # Past the slot the ids are refused by count alone, before the vocabulary is checked.
    field = "prompt is" if length == 64 else "token_ids.ids: the prompt has"
    assert field in str(info.value) and str(length) in str(info.value)
    assert info.value.field == "token_ids.ids"


def test_prompt_one_short_of_the_slot_fits_one_token() -> None:
    message = pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1] * 63))
    assert _validate(message, slot_context=64).max_tokens == 1


def test_chat_prompt_length_counts_the_template() -> None:
    message = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x" * 60)])
    )
    with pytest.raises(PromptTooLongError):
        _validate(message, slot_context=63)  # 60 characters + 4 template tokens


class RefusingTokenizer(FakeTokenizer):
    """Fails the test if anything is tokenized."""

    max_token_chars = 3

    def encode(self, text: str) -> list[int]:
        raise AssertionError("tokenized")

    def render_chat(
        self, turns: list[ChatTurn], *, allow_special_tokens: bool = False
    ) -> list[int]:
        raise AssertionError("tokenized")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.GenerateRequest(text="x" * (3 * 64 + 1)), "text: the prompt is 193 characters"),
        (
            pb.GenerateRequest(
                chat=pb.ChatInput(
                    messages=[
                        pb.ChatMessage(role="system", content="s" * 100),
                        pb.ChatMessage(role="user", content="u" * 93),
                    ]
                )
            ),
            "chat.messages: the prompt's content totals 193 characters",
        ),
        (
            pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[10**6] * 65)),
            "token_ids.ids: the prompt has 65",
        ),
    ],
)
def test_oversized_input_is_refused_by_size_before_tokenizing(message, field: str) -> None:
    for refuse in (
        lambda: generation_request(
            message,
            RefusingTokenizer(),
            slot_context=64,
            default_max_tokens=1,
            prompt_cache_enabled=True,
        ),
        lambda: prompt_token_ids(message, RefusingTokenizer(), slot_context=64),
    ):
        with pytest.raises(PromptTooLongError) as info:
            refuse()
        assert str(info.value).startswith(field)
        assert info.value.field == field.split(":")[0]


def test_input_at_the_size_bound_is_tokenized() -> None:
    message = pb.GenerateRequest(text="x" * (3 * 64))  # might still fit: tokenize it
    with pytest.raises(AssertionError, match="tokenized"):
        prompt_token_ids(message, RefusingTokenizer(), slot_context=64)


# -- response_format ----------------------------------------------------------------------------


def test_response_formats_become_the_requests_format() -> None:
    assert _validate(_text()).response_format is None
    assert _validate(_text(response_format=pb.ResponseFormat())).response_format is None
    schema = '{"type": "object"}'
    cases = [
        (pb.ResponseFormat(json_schema=schema), ResponseFormat("json_schema", schema)),
        (pb.ResponseFormat(json_object=True), ResponseFormat("json_object")),
        (pb.ResponseFormat(regex="[a-z]+"), ResponseFormat("regex", "[a-z]+")),
        (pb.ResponseFormat(grammar='start: "a"'), ResponseFormat("grammar", 'start: "a"')),
        (
            pb.ResponseFormat(choice=pb.ChoiceList(options=["a", "b"])),
            ResponseFormat("choice", options=("a", "b")),
        ),
    ]
    for message, expected in cases:
        assert _validate(_text(response_format=message)).response_format == expected
        stream = pb.StreamGenerateRequest(text="hi", response_format=message)
        assert _validate(stream).response_format == expected


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        (pb.ResponseFormat(json_schema=""), "response_format.json_schema"),
        (pb.ResponseFormat(regex=" "), "response_format.regex"),
        (pb.ResponseFormat(grammar=""), "response_format.grammar"),
        (pb.ResponseFormat(json_object=False), "response_format.json_object"),
        (pb.ResponseFormat(choice=pb.ChoiceList()), "response_format.choice.options"),
        (
            pb.ResponseFormat(choice=pb.ChoiceList(options=["a", "b", ""])),
            "response_format.choice.options[2]",
        ),
    ],
)
def test_malformed_response_formats_name_their_field(response_format, field) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        _validate(_text(response_format=response_format))
    assert refused.value.field == field
