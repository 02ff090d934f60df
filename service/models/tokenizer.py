"""Tokenizers: one small interface over the GGUF vocabulary and Hugging Face tokenizers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# GGUF token types (llama.cpp's enum): 3 = control (special) token.
_GGUF_TOKEN_TYPE_CONTROL = 3
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
EOS_FILE = "mlxserve_eos_token_ids.json"


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
        self._backend_decode = (
            backend.decode
            if backend is not None and not getattr(hf, "clean_up_tokenization_spaces", False)
            else None
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
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=False)
        return self._hf.decode(list(token_ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self._hf.convert_ids_to_tokens(int(token_id)) or ""

    def render_chat(self, turns: Sequence[ChatTurn]) -> list[int]:
        """The prompt token ids of a chat, ending with the assistant turn's header."""
        messages = [{"role": t.role, "content": t.content} for t in turns]
        if not self.has_chat_template:
            # A model without a template gets a plain transcript rather than an error.
            text = "".join(f"{t.role}: {t.content}\n" for t in turns) + "assistant:"
            return self.encode(text)
        text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)


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
