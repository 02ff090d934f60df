"""Turn a GenerateRequest into a validated GenerationRequest, or say which field is wrong."""

from __future__ import annotations

import math
import uuid
from collections.abc import Collection
from typing import Protocol

from mlxserve.v1 import generation_pb2 as pb
from service.common.tokenizer import CHAT_ROLES, ChatTurn
from service.protocol import GenerationRequest, ResponseFormat, SamplingParams

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_REQUEST_ID_LEN = 128
# Where a prompt too long once tokenized is, by input kind.
_INPUT_FIELD = {"text": "text", "token_ids": "token_ids.ids", "chat": "chat.messages"}


class InvalidRequestError(ValueError):
    """Bad input; the message names the field. Maps to INVALID_ARGUMENT, with `field` (its
    path in the request, e.g. `sampling.top_p` or `chat.messages[2].role`) as the
    google.rpc.BadRequest field violation."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(InvalidRequestError):
    pass


class UnknownAdapterError(LookupError):
    """The request names a LoRA adapter the server does not serve (NOT_FOUND)."""

    def __init__(self, name: str, served: Collection[str]) -> None:
        listed = ", ".join(served) if served else "none (the server runs without --adapter)"
        super().__init__(f"adapter {name!r} is not served; served adapters: {listed}")
        self.name = name
        self.served = list(served)


class PromptEncoder(Protocol):
    vocab_size: int
    max_token_chars: int  # the longest token, in characters of the text it encodes

    def encode(self, text: str) -> list[int]: ...
    def render_chat(
        self, turns: list[ChatTurn], *, allow_special_tokens: bool = False
    ) -> list[int]: ...


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if math.isnan(value) or value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise InvalidRequestError(
            f"sampling.{name} must be within {bracket}{lo}, {hi}], got {value}",
            field=f"sampling.{name}",
        )


def check_prompt_size(
    message: pb.GenerateRequest | pb.TokenizeRequest, tok: PromptEncoder, slot_context: int
) -> None:
    """Refuse, before any tokenization, input too big for the slot context whatever it
    tokenizes to: more token ids than the slot holds, or more characters than
    slot_context * the longest token (a chat's template only adds to its content)."""
    kind = message.WhichOneof("input")
    max_chars = slot_context * tok.max_token_chars
    if kind == "token_ids":
        n = len(message.token_ids.ids)
        if n > slot_context:
            raise PromptTooLongError(
                f"token_ids.ids: the prompt has {n} ids; the slot context is {slot_context} tokens",
                field="token_ids.ids",
            )
    elif kind == "text":
        n = len(message.text)
        if n > max_chars:
            raise PromptTooLongError(
                f"text: the prompt is {n} characters; the slot context of {slot_context} tokens "
                f"holds at most {max_chars} (no token of this model is longer than "
                f"{tok.max_token_chars})",
                field="text",
            )
    elif kind == "chat":
        n = sum(len(m.content) for m in message.chat.messages)
        if n > max_chars:
            raise PromptTooLongError(
                f"chat.messages: the prompt's content totals {n} characters; the slot context of "
                f"{slot_context} tokens holds at most {max_chars} (no token of this model is "
                f"longer than {tok.max_token_chars})",
                field="chat.messages",
            )


def prompt_token_ids(
    message: pb.GenerateRequest | pb.TokenizeRequest,
    tok: PromptEncoder,
    *,
    slot_context: int | None,
    allow_special_tokens_in_content: bool = False,
) -> list[int]:
    """The prompt's token ids; slow for big input (tokenization): keep it off the event loop.
    Input too big for `slot_context` by its size alone is refused first (None: counted
    whatever its size). Special tokens typed into chat content stay plain text unless
    `allow_special_tokens_in_content`; raw `text` is the caller's whole prompt and is encoded
    as it is."""
    kind = message.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError(
            "input is required: set one of text, token_ids or chat", field="input"
        )
    if slot_context is not None:
        check_prompt_size(message, tok, slot_context)
    if kind == "text":
        if not message.text:
            raise InvalidRequestError("text must not be empty", field="text")
        return tok.encode(message.text)
    if kind == "token_ids":
        ids = list(message.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids.ids must not be empty", field="token_ids.ids")
        bad = next((i for i, t in enumerate(ids) if t >= tok.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token_ids.ids contains {ids[bad]}, outside the vocabulary [0, {tok.vocab_size})",
                field=f"token_ids.ids[{bad}]",
            )
        return ids
    messages = message.chat.messages
    if not messages:
        raise InvalidRequestError("chat.messages must not be empty", field="chat.messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role {m.role!r} is unknown; use one of {sorted(CHAT_ROLES)}",
                field=f"chat.messages[{i}].role",
            )
    return tok.render_chat(
        [ChatTurn(m.role, m.content) for m in messages],
        allow_special_tokens=allow_special_tokens_in_content,
    )


def sampling_params(s: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    p = SamplingParams()
    kw: dict = {}
    if s.HasField("temperature"):
        _check_range("temperature", s.temperature, 0.0, 100.0)
        kw["temperature"] = float(s.temperature)
    if s.HasField("top_p"):
        _check_range("top_p", s.top_p, 0.0, 1.0, lo_open=True)
        kw["top_p"] = float(s.top_p)
    if s.HasField("top_k"):
        if s.top_k < 0:
            raise InvalidRequestError(
                f"sampling.top_k must be >= 0, got {s.top_k}", field="sampling.top_k"
            )
        kw["top_k"] = int(s.top_k)
    if s.HasField("min_p"):
        _check_range("min_p", s.min_p, 0.0, 1.0)
        kw["min_p"] = float(s.min_p)
    if s.HasField("repetition_penalty"):
        _check_range("repetition_penalty", s.repetition_penalty, 0.0, 10.0, lo_open=True)
        kw["repetition_penalty"] = float(s.repetition_penalty)
    for name in ("presence_penalty", "frequency_penalty"):
        if s.HasField(name):
            _check_range(name, getattr(s, name), -2.0, 2.0)
            kw[name] = float(getattr(s, name))
    if s.HasField("seed"):
        kw["seed"] = int(s.seed) & ((1 << 63) - 1)
    if s.logit_bias:
        for token, bias in s.logit_bias.items():
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"sampling.logit_bias key {token} is outside the vocabulary [0, {vocab_size})",
                    field=f"sampling.logit_bias[{token}]",
                )
            if math.isnan(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"sampling.logit_bias[{token}] must be within [-100, 100], got {bias}",
                    field=f"sampling.logit_bias[{token}]",
                )
        kw["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items()))
    return SamplingParams(**{**p.__dict__, **kw})


def response_format(
    message: pb.GenerateRequest | pb.StreamGenerateRequest,
) -> ResponseFormat | None:
    """The request's response format, checked for what needs no grammar engine (the engine's
    compile judges the rest); None when it is unset or empty."""
    if not message.HasField("response_format"):
        return None
    rf = message.response_format
    kind = rf.WhichOneof("format")
    if kind is None:
        return None
    field = f"response_format.{kind}"
    if kind == "json_object":
        if not rf.json_object:
            raise InvalidRequestError(
                "response_format.json_object must be true (leave response_format unset for "
                "free text)",
                field=field,
            )
        return ResponseFormat(kind)
    if kind == "choice":
        options = list(rf.choice.options)
        if not options:
            raise InvalidRequestError(
                "response_format.choice.options must name at least one string",
                field="response_format.choice.options",
            )
        empty = next((i for i, o in enumerate(options) if not o), None)
        if empty is not None:
            raise InvalidRequestError(
                "response_format.choice.options must not contain empty strings",
                field=f"response_format.choice.options[{empty}]",
            )
        return ResponseFormat(kind, options=tuple(options))
    text = {"json_schema": rf.json_schema, "regex": rf.regex, "grammar": rf.grammar}[kind]
    if not text.strip():
        raise InvalidRequestError(f"{field} must not be empty", field=field)
    return ResponseFormat(kind, text)


def generation_request(
    message: pb.GenerateRequest | pb.StreamGenerateRequest,
    tok: PromptEncoder,
    *,
    slot_context: int,
    default_max_tokens: int,
    prompt_cache_enabled: bool,
    allow_special_tokens_in_content: bool = False,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    """`adapters`: the LoRA adapters served (a request naming another raises
    UnknownAdapterError)."""
    request_id = message.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(
            f"request_id is longer than {MAX_REQUEST_ID_LEN} characters", field="request_id"
        )
    if message.adapter and message.adapter not in adapters:
        raise UnknownAdapterError(message.adapter, adapters)
    prompt = prompt_token_ids(
        message,
        tok,
        slot_context=slot_context,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
    )
    if len(prompt) >= slot_context:
        raise PromptTooLongError(
            f"prompt is {len(prompt)} tokens; the slot context is {slot_context} tokens "
            "(prompt plus at least one generated token must fit)",
            field=_INPUT_FIELD[message.WhichOneof("input") or "text"],
        )
    stopping = message.stopping
    room = slot_context - len(prompt)
    if stopping.HasField("max_tokens"):
        if stopping.max_tokens < 1:
            raise InvalidRequestError(
                "stopping.max_tokens must be at least 1", field="stopping.max_tokens"
            )
        max_tokens = min(int(stopping.max_tokens), room)
    else:
        max_tokens = min(default_max_tokens, room)
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stopping.stop has more than {MAX_STOP_STRINGS} strings", field="stopping.stop"
        )
    empty = next((i for i, s in enumerate(stopping.stop) if not s), None)
    if empty is not None:
        raise InvalidRequestError(
            "stopping.stop must not contain empty strings", field=f"stopping.stop[{empty}]"
        )
    ids = stopping.stop_token_ids
    bad = next((i for i, t in enumerate(ids) if t >= tok.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"stopping.stop_token_ids contains {ids[bad]}, outside the vocabulary",
            field=f"stopping.stop_token_ids[{bad}]",
        )
    if message.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be within [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs"
        )
    if message.top_logprobs and not message.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", field="top_logprobs")
    cache_prompt = message.cache_prompt if message.HasField("cache_prompt") else True
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling_params(message.sampling, tok.vocab_size),
        max_tokens=max_tokens,
        stop=tuple(stopping.stop),
        stop_token_ids=frozenset(int(t) for t in stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        priority=int(message.priority),
        logprobs=message.logprobs,
        top_logprobs=int(message.top_logprobs),
        cache_prompt=cache_prompt and prompt_cache_enabled,
        response_format=response_format(message),
        adapter=message.adapter,
    )


def kv_budget_refusal(
    capacity_tokens: int | None, prompt_tokens: int, max_tokens: int
) -> str | None:
    """Why a request can never fit the KV budget (None: it can, or there is no budget)."""
    needed = prompt_tokens + max_tokens
    if capacity_tokens is not None and needed > capacity_tokens:
        return (
            f"the KV cache budget holds {capacity_tokens} tokens; this request needs up to "
            f"{needed} (prompt {prompt_tokens} + max_tokens {max_tokens})"
        )
    return None
