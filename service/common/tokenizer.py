"""Tokenizers: one small interface over the GGUF vocabulary and Hugging Face tokenizers."""

from __future__ import annotations

import bisect
import json
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# GGUF token types (llama.cpp's enum): 3 = control (special) token.
_GGUF_TOKEN_TYPE_CONTROL = 3
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
EOS_FILE = "mlxserve_eos_token_ids.json"
_WHITESPACE = re.compile(r"\s*")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


class Tokenizer:
    """What the service needs of a tokenizer: encode, decode, chat rendering, EOS ids."""

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]) -> None:
        self._hf = hf
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size: int = len(hf)
        self.has_chat_template: bool = bool(getattr(hf, "chat_template", None))
        # A token covers at most its piece's length of input (a byte-level piece has one
        # character per byte), so a text of n characters has at least n / max_token_chars
        # tokens: requests can be refused by size before they are tokenized. (A normalizer that
        # shrinks input, e.g. collapsing runs of spaces, can beat this; such input is still
        # that long in characters.)
        pieces = hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        self.max_token_chars: int = max((len(p) for p in pieces if p), default=1)
        self._byte_decoder = _byte_level_decoder(hf)
        self._token_bytes: dict[int, bytes] = {}
        # The Rust tokenizer's decode, when the wrapper would add nothing to it (the wrapper's
        # Python conversions cost more than the decode itself, twice per generated token).
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None:
            # Prompts are encoded on several threads while the scheduler decodes: with no
            # truncation or padding configured, transformers never reconfigures the shared Rust
            # tokenizer inside encode (that mutation fails "Already borrowed" under a
            # concurrent call). We never truncate or pad.
            backend.no_truncation()
            backend.no_padding()
        self._backend = backend
        self._backend_decode = (
            backend.decode
            if backend is not None and not getattr(hf, "clean_up_tokenization_spaces", False)
            else None
        )
        # Special tokens by their text, longest first (one may be a prefix of another).
        self._specials: dict[str, tuple[int, AddedToken]] = {
            str(t): (int(i), t) for i, t in hf.added_tokens_decoder.items() if t.special
        }
        names = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        # Built on first use (content that spells a special token is rare): copying the Rust
        # tokenizer parses its whole definition, which every process start would pay.
        self._plain: Callable[[str], list[int]] | None = None
        self._plain_lock = threading.Lock()
        self._text_bytes: dict[int, bytes] = {}
        # A byte-level tokenizer whose decode is the byte map's UTF-8 (nothing cleaned up, every
        # added token decoding to its bytes): generated text from each token's bytes alone.
        self.text_bytes: Callable[[int], bytes] | None = (
            self.token_bytes if self._bytes_decode_exactly() else None
        )

    def ends_mid_character(self, token_ids: Sequence[int]) -> bool | None:
        """Whether these tokens' bytes end inside a UTF-8 character; None when the tokenizer is
        not byte-level (then the caller has to judge from the decoded text)."""
        if self._byte_decoder is None:
            return None
        data = b"".join(self._bytes_of(t) for t in token_ids)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return exc.end == len(data) and exc.reason == "unexpected end of data"
        return False

    def _bytes_decode_exactly(self) -> bool:
        if self._byte_decoder is None or self._backend_decode is None:
            return False
        added = [int(i) for i in self._hf.added_tokens_decoder]
        decode = self._backend_decode
        return all(
            decode([i], skip_special_tokens=False).encode("utf-8") == self.token_bytes(i)
            for i in added
        )

    def _encode_plain(self, text: str) -> list[int]:
        """`text` encoded with special-token text as plain text (_plain_encoder)."""
        plain = self._plain
        if plain is None:
            with self._plain_lock:
                if self._plain is None:
                    self._plain = _plain_encoder(self._hf)
                plain = self._plain
        return plain(text)

    def _bytes_of(self, token_id: int) -> bytes:
        """A token's bytes under the byte-level map (special tokens: none), cached."""
        data = self._token_bytes.get(token_id)
        if data is None:
            table = self._byte_decoder
            assert table is not None
            piece = self._hf.convert_ids_to_tokens(int(token_id)) or ""
            whole = piece and all(ch in table for ch in piece)  # special tokens are whole text
            data = bytes(table[ch] for ch in piece) if whole else b""
            self._token_bytes[token_id] = data
        return data

    def save(self, directory: Path) -> None:
        """Write the tokenizer (Hugging Face files) and its EOS ids, for `Tokenizer.load`: the
        engine core loads the model, the front-end processes only its tokenizer."""
        self._hf.save_pretrained(str(directory))
        (directory / EOS_FILE).write_text(json.dumps(sorted(self.eos_token_ids)))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        hf = PreTrainedTokenizerFast.from_pretrained(str(directory))
        return cls(hf, json.loads((directory / EOS_FILE).read_text()))

    def encode(self, text: str) -> list[int]:
        if self._backend is not None and text:
            # The Rust tokenizer itself: the same ids (no truncation, padding or special-token
            # splitting is configured) without the wrapper's per-call Python.
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self._hf.encode(text, add_special_tokens=False))

    def tokenizer_json(self) -> str | None:
        """The fast tokenizer's definition (`tokenizer.json` text) without padding or
        truncation, what the grammar engine reads; None for a tokenizer that has none."""
        if self._backend is None:
            return None
        return self._backend.to_str()

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=False)
        return self._hf.decode(list(token_ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        """The token's vocabulary entry, as the tokenizer spells it (e.g. "Ġthe")."""
        return self._hf.convert_ids_to_tokens(int(token_id)) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for in generated text: a byte-level BPE piece through the
        byte map, a SentencePiece byte token (`<0xE2>`) as that byte, `▁` as a space; a special
        token is its text. Cached: detokenization asks once per generated token."""
        data = self._text_bytes.get(token_id)
        if data is None:
            data = self._text_bytes[token_id] = self._piece_bytes(token_id)
        return data

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.id_to_token(token_id)
        if self._byte_decoder is not None:
            data = self._bytes_of(token_id)
            return data if data or not piece else piece.encode("utf-8")
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def render_chat(
        self, turns: Sequence[ChatTurn], *, allow_special_tokens: bool = False
    ) -> list[int]:
        """The prompt token ids of a chat, ending with the assistant turn's header.

        Special tokens typed into a message's content (`<|im_end|>`, `<|im_start|>system`) are
        encoded as the plain text they are, so a user cannot end a turn or forge another;
        only the template's own special tokens are control tokens. `allow_special_tokens`
        parses them in content too. Content without special-token text gives the same ids
        either way."""
        pattern = self._special_re
        if (
            allow_special_tokens
            or pattern is None
            or not any(pattern.search(t.content) for t in turns)
        ):
            return self.encode(self._render(turns))
        return self._render_specials_as_text(turns, pattern)

    def _render(self, turns: Sequence[ChatTurn]) -> str:
        if not self.has_chat_template:
            # A model without a template gets a plain transcript rather than an error.
            return "".join(f"{t.role}: {t.content}\n" for t in turns) + "assistant:"
        messages = [{"role": t.role, "content": t.content} for t in turns]
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _render_specials_as_text(
        self, turns: Sequence[ChatTurn], pattern: re.Pattern[str]
    ) -> list[int]:
        # Render with each special token in content replaced by a marker no input can contain
        # (a fresh nonce), so the template sees ordinary text; then put the tokens back and
        # remember where they are.
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def to_marker(match: re.Match[str]) -> str:
            found.append(match.group())
            return f"\ue000{nonce}.{len(found) - 1}\ue001"

        masked = [ChatTurn(t.role, pattern.sub(to_marker, t.content)) for t in turns]
        rendered = self._render(masked)
        marker = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")
        pieces: list[str] = []
        content_spans: list[tuple[int, int]] = []
        length = last = 0
        for match in marker.finditer(rendered):
            pieces.append(rendered[last : match.start()])
            length += match.start() - last
            special = found[int(match.group(1))]
            pieces.append(special)
            content_spans.append((length, length + len(special)))
            length += len(special)
            last = match.end()
        pieces.append(rendered[last:])
        text = "".join(pieces)

        # The tokenizer splits its input at special tokens and encodes the text between them
        # on its own; do the same at the template's special tokens only.
        span_ends = [end for _, end in content_spans]
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(text):
            i = bisect.bisect_right(span_ends, match.start())  # the first span ending after it
            if i < len(content_spans) and content_spans[i][0] < match.end():
                continue  # typed by the user: stays text
            token_id, token = self._specials[match.group()]
            segment = text[start : match.start()]
            ids += self._encode_plain(segment.rstrip() if token.lstrip else segment)
            ids.append(token_id)
            start = _WHITESPACE.match(text, match.end()).end() if token.rstrip else match.end()
        ids += self._encode_plain(text[start:])
        return ids


def _plain_encoder(hf: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """Encodes text with special tokens taken as plain text. A copy of the Rust tokenizer with
    `encode_special_tokens` set: switching that flag on the shared one would race with the
    threads encoding prompts."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return lambda text: list(
            hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        )
    plain = RawTokenizer.from_str(backend.to_str())
    plain.no_truncation()
    plain.no_padding()
    plain.encode_special_tokens = True
    return lambda text: plain.encode(text, add_special_tokens=False).ids if text else []


def _byte_level_decoder(hf: PreTrainedTokenizerBase) -> dict[str, int] | None:
    """GPT-2 byte-level BPE maps each byte to one printable character; invert that map."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    # GPT-2's table: printable bytes map to themselves, the rest to code points from 256 up.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    extra = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(extra)
            extra += 1
    return {ch: byte for byte, ch in table.items()}


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """Build the GPT-2 byte-level BPE tokenizer described by a GGUF file's metadata."""
    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model_kind!r} (only 'gpt2' BPE)")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    token_types = metadata.get("tokenizer.ggml.token_type")
    types = token_types.tolist() if token_types is not None else [1] * len(tokens)

    vocab = {tok: i for i, tok in enumerate(tokens)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = metadata.get("tokenizer.ggml.pre", "")
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits off every digit before the GPT-2 regex.
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        raw.pre_tokenizer = byte_level
    raw.decoder = decoders.ByteLevel()
    specials = [tok for tok, kind in zip(tokens, types) if kind == _GGUF_TOKEN_TYPE_CONTROL]

    def special(key: str) -> str | None:
        value = metadata.get(key)
        return tokens[int(value.item())] if value is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"),
        unk_token=special("tokenizer.ggml.unknown_token_id"),
        pad_token=special("tokenizer.ggml.padding_token_id"),
        additional_special_tokens=specials,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    eos_ids = [int(metadata["tokenizer.ggml.eos_token_id"].item())]
    # Chat models end a turn with <|im_end|>; treat it as end of sequence too.
    if "<|im_end|>" in vocab:
        eos_ids.append(vocab["<|im_end|>"])
    return Tokenizer(hf, eos_ids)


def tokenizer_from_hf(hf: PreTrainedTokenizerBase, eos_token_ids: Sequence[int]) -> Tokenizer:
    return Tokenizer(hf, eos_token_ids)
