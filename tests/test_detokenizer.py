"""IncrementalDetokenizer with the real GGUF tokenizer of the embedded model."""

from __future__ import annotations

import codecs

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from service.common.tokenizer import Tokenizer, tokenizer_from_gguf
from service.core.models.loader import embedded_gguf_path
from service.frontend.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.model

MULTIBYTE = "café ☕ 日本語 🎉"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    _, metadata = mx.load(str(embedded_gguf_path()), return_metadata=True)
    return tokenizer_from_gguf(metadata)


def _detokenizer(tok: Tokenizer, stops: list[str] | None = None) -> IncrementalDetokenizer:
    """Wired as the server wires it: byte-level tokenizers tell where characters end, and the
    embedded one's text is its tokens' bytes (no decode per token)."""
    assert tok.text_bytes is not None
    return IncrementalDetokenizer(tok.decode, stops or (), tok.ends_mid_character, tok.text_bytes)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=24))
def test_the_byte_path_gives_the_tokenizers_text_for_any_ids(tok: Tokenizer, ids) -> None:
    """Any ids a model may emit (special tokens, bytes that never form a character): the text
    is the tokenizer's decode of them all, but for a last character whose bytes never all came;
    where the bytes are well-formed UTF-8, each delta is the one decoding token windows gives."""
    by_bytes = _detokenizer(tok)
    deltas = [*_push_all(by_bytes, ids), by_bytes.flush()]
    data = b"".join(tok.token_bytes(i) for i in ids)
    tail = codecs.getincrementaldecoder("utf-8")("replace")
    tail.decode(data)
    if tail.getstate()[0] == b"":  # no character left incomplete at the end
        assert "".join(deltas) == tok.decode(ids)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return
    by_decode = IncrementalDetokenizer(tok.decode, (), tok.ends_mid_character)
    assert deltas == [*_push_all(by_decode, ids), by_decode.flush()]


def test_text_only_heuristic_never_emits_split_bytes(tok: Tokenizer) -> None:
    """Without byte information a trailing U+FFFD is held back and, at the end, dropped."""
    ids = tok.encode("ok 🎉")
    detok = IncrementalDetokenizer(tok.decode)
    out = "".join(_push_all(detok, ids[:-1])) + detok.flush()
    assert "\ufffd" not in out and out.startswith("ok")
    detok = IncrementalDetokenizer(tok.decode)
    assert "".join(_push_all(detok, ids)) + detok.flush() == "ok 🎉"


def _push_all(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # The point of the test: some characters really span several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = _detokenizer(tok)
    deltas = _push_all(detok, ids)
    for delta in deltas:
        assert "\ufffd" not in delta
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert detok.text == MULTIBYTE
    # Each character comes out whole, as soon as its last byte arrives.
    assert set("".join(deltas)) >= {"☕", "日", "本", "語", "🎉", "é"}
    assert deltas[-2].endswith("🎉") and deltas[-1] == ""


def test_an_incomplete_last_character_is_never_emitted(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    assert len(tok.encode("🎉")) > 1
    detok = _detokenizer(tok)
    out = "".join(_push_all(detok, ids[:-1])) + detok.flush()  # cut inside the emoji
    assert "\ufffd" not in out
    # The token holding the emoji's first bytes also holds the space before it; the space
    # may be dropped with the incomplete character.
    assert out.startswith("ok") and "ok ".startswith(out)


def test_each_delta_is_released_as_soon_as_it_is_final(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris.")
    detok = _detokenizer(tok)
    assert _push_all(detok, ids) == [tok.decode([i]) for i in ids]


def test_stop_string_across_token_boundaries_is_held_back_and_cut(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris.")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[3:5] == [" France", " is"]  # the stop string spans two tokens
    detok = _detokenizer(tok, ["France is"])
    deltas = []
    for i in ids:
        deltas.append(detok.push(i))
        if detok.stopped:
            break
    assert detok.stopped
    assert deltas == ["The", " capital", " of", " ", ""]  # "France" held back, then cut
    assert "".join(deltas) == "The capital of " == detok.text
    assert detok.push(ids[-1]) == "" and detok.flush() == ""  # nothing after the stop


def test_stop_string_inside_one_token_cuts_the_rest(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris.")
    detok = _detokenizer(tok, ["ari"])
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == "The capital of France is P"
    assert detok.stopped


def test_flush_releases_text_held_for_a_stop_string_that_never_came(tok: Tokenizer) -> None:
    text = "The capital of France is Paris"
    ids = tok.encode(text)
    detok = _detokenizer(tok, ["Paris!", "xyz"])
    deltas = _push_all(detok, ids)
    assert "".join(deltas) == "The capital of France is "  # " Paris" could start "Paris!"
    assert not detok.stopped
    assert detok.flush() == "Paris"
    assert detok.text == text


def test_held_back_text_is_released_once_the_stop_string_is_ruled_out(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris.")
    detok = _detokenizer(tok, ["France was"])
    deltas = _push_all(detok, ids)
    assert deltas[3] == " "  # "France" could begin "France was"
    assert deltas[4] == "France is"  # " is" rules it out
    assert "".join(deltas) + detok.flush() == tok.decode(ids)


def test_stop_string_split_inside_a_multibyte_character(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    detok = _detokenizer(tok, ["日本"])
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == "café ☕ "
    assert "\ufffd" not in out


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=1, max_size=40))
def test_push_all_then_flush_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # SmolLM2's vocabulary lacks a few byte tokens (0xF1, 0xF2, 0xF5-0xFF, some control
    # bytes): text using them does not survive encoding, which is not the detokenizer's concern.
    assume(tok.decode(ids) == text)
    detok = _detokenizer(tok)
    deltas = [*_push_all(detok, ids), detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", ["a\ufffd", "\ufffd", "x \ufffd y"])
def test_a_real_replacement_character_is_text_too(tok: Tokenizer, text: str) -> None:
    """U+FFFD is a valid character a model can generate (bytes EF BF BD, complete): it must
    reach the output even when it is the last thing generated."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = _detokenizer(tok)
    assert "".join(_push_all(detok, ids)) + detok.flush() == text


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    text=st.text(alphabet=st.sampled_from("ab é☕日🎉\n"), min_size=1, max_size=30),
    stop=st.text(alphabet=st.sampled_from("ab é☕日🎉\n"), min_size=1, max_size=3),
)
def test_stop_string_never_leaks(tok: Tokenizer, text: str, stop: str) -> None:
    ids = tok.encode(text)
    detok = _detokenizer(tok, [stop])
    out = ""
    for i in ids:
        out += detok.push(i)
        assert stop not in out
        if detok.stopped:
            break
    out += detok.flush()
    full = tok.decode(ids)
    if stop in full:
        assert detok.stopped
        assert out == full[: full.index(stop)]
    else:
        assert out == full
