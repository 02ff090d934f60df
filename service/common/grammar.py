"""Structured output: response formats compiled to grammars, per-row matchers, token bitmasks.

The engine is llguidance (https://github.com/guidance-ai/llguidance), chosen by measurement
(docs/structured-output.md). Both processes use this module: a front end compiles a request's
format to refuse a bad one before it is queued, and the engine core compiles it again (cached)
before admitting the request, then gives each constrained row a `Matcher`. Pure Python, numpy
and llguidance: no MLX, no gRPC.

Bitmask layout (llguidance's): row r allows token t iff `(mask[r, t // 32] >> (t % 32)) & 1`.
A row left at all ones (-1) is unconstrained, so one `where` over a whole batch leaves the
unconstrained rows' logits bit for bit as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import llguidance as llg
import numpy as np
import structlog

from service.common.os_thread import named_executor
from service.protocol import FORMAT_KINDS, ResponseFormat

if TYPE_CHECKING:
    from service.common.config import StructuredOutputConfig
    from service.common.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

ENGINE = "llguidance"
ENGINE_VERSION: str = llg.__version__
GRAMMAR_SYNTAX = "llguidance Lark"  # the dialect of ResponseFormat.grammar
GRAMMAR_SYNTAX_URL = "https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md"

# JSON as json.dumps writes it by default (", " and ": ", no other whitespace): with free
# whitespace a small model can loop on whitespace until max_tokens. A schema may override these
# with llguidance's "x-guidance" key.
DEFAULT_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # an unsupported keyword is refused, never silently left unenforced
}
# llguidance's lexer runs at about 50k fuel units per ms (its docs): the compile's fuel is
# scaled to the time budget, so the engine stops itself near the deadline.
_FUEL_PER_MS = 50_000
_MIN_INITIAL_FUEL = 1_000_000
MAX_FORMAT_BYTES = 1 << 20
# Codes of a refusal (GrammarError.code): all are INVALID_ARGUMENT for the caller.
INVALID, UNSUPPORTED, TOO_COMPLEX, TIMEOUT = "invalid", "unsupported", "too_complex", "timeout"
_ENGINE_DUMP = re.compile(r"\n?<state>|\n?<grammar>")
_TOO_COMPLEX_WORDS = ("fuel", "too many", "too complex", "too large", "limit", "stack level")
_UNSUPPORTED_WORDS = (
    "unimplemented",
    "not supported",
    "unsupported",
    "only supported",
    "unknown format",
    "not disjoint",
)


class GrammarError(ValueError):
    """A format the engine refuses; `reason` is what the caller is told, `code` one of
    invalid (malformed), unsupported (valid, but not within what the engine enforces),
    too_complex (an engine limit), timeout (over --max-grammar-compile-ms)."""

    def __init__(self, reason: str, code: str = INVALID) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


def format_field(kind: str) -> str:
    """The request field a refusal of this kind of format names."""
    return "response_format.choice.options" if kind == "choice" else f"response_format.{kind}"


def format_key(fmt: ResponseFormat) -> str:
    """The cache key: the same format under the same engine version, in any process."""
    blob = json.dumps([ENGINE_VERSION, fmt.kind, fmt.text, list(fmt.options)])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _clean(message: str) -> str:
    """Engine messages may carry a parser-state dump and the whole grammar: not for callers."""
    return _ENGINE_DUMP.split(message, maxsplit=1)[0].strip()


def to_llguidance_grammar(fmt: ResponseFormat, json_options: dict[str, Any]) -> str:
    """The engine's grammar for a format; raises GrammarError for what is malformed before the
    engine sees it (text that is not JSON, an empty choice, an unknown kind)."""
    kind = fmt.kind
    if kind == "json_schema":
        try:
            schema = json.loads(fmt.text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if schema is True:
            schema = {}
        if schema is False:
            raise GrammarError("json_schema is `false`: no document satisfies it", UNSUPPORTED)
        if not isinstance(schema, dict):
            raise GrammarError("json_schema must be a JSON object (or true)")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
        except ValueError as exc:
            raise engine_refusal(fmt, str(exc)) from None
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
    if kind == "regex":
        if not fmt.text:
            raise GrammarError("regex is empty")
        return llg.LLMatcher.grammar_from_regex(fmt.text)
    if kind == "grammar":
        if not fmt.text.strip():
            raise GrammarError("grammar is empty")
        return llg.LLMatcher.grammar_from_lark(fmt.text)
    if kind == "choice":
        if not fmt.options:
            raise GrammarError("choice needs at least one option")
        if any(o == "" for o in fmt.options):
            raise GrammarError("choice options must be non-empty strings")
        # A Lark alternation of string literals (JSON escapes are Lark's), as llguidance's
        # own grammar_from("choice") builds it.
        unique = list(dict.fromkeys(fmt.options))
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, unique)))
    raise GrammarError(f"unknown response_format kind {kind!r}; expected one of {FORMAT_KINDS}")


def engine_refusal(fmt: ResponseFormat, message: str) -> GrammarError:
    """An engine error as a refusal: a precise message and its code."""
    message = _clean(message)
    low = message.lower()
    what = "grammar (llguidance Lark syntax)" if fmt.kind == "grammar" else fmt.kind
    if any(w in low for w in _TOO_COMPLEX_WORDS):
        return GrammarError(
            f"{what} is too complex for the engine's limits: {message}", TOO_COMPLEX
        )
    if any(w in low for w in _UNSUPPORTED_WORDS):
        return GrammarError(
            f"{what} uses a feature {ENGINE} does not support: {message}", UNSUPPORTED
        )
    if fmt.kind == "regex":
        # The engine reports a regex as the Lark rule it wraps it in.
        return GrammarError(f"regex is invalid: {message.replace('(in regex)', '').strip()}")
    return GrammarError(f"{what} is invalid: {message}")


def make_tokenizer(
    tokenizer_json: str, eos_token_ids: Sequence[int], vocab_size: int
) -> llg.LLTokenizer:
    """The engine's view of a Hugging Face fast tokenizer (its `tokenizer.json` text).
    `vocab_size`: the model's logits width (padded ids beyond the vocabulary are never
    allowed). Every EOS id is allowed exactly where the grammar may end. Build it once per
    process: it walks the whole vocabulary."""
    eos = [int(t) for t in eos_token_ids]
    if not eos:
        raise ValueError("the grammar engine needs at least one EOS token id")
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(V / 32)], all ones: unconstrained."""
    return np.full((rows, mask_words(vocab_size)), -1, dtype=np.int32)


@dataclass
class Compiled:
    """One compiled format: matchers that never advance, which rows copy.

    A copy shares its original's lexer, and llguidance locks a lexer while it computes a mask
    or takes a token; so the rows of a batch filled in parallel wait on each other when they
    all copy one matcher. The engine core's cache therefore builds more originals in the
    background (`GrammarCache(lexers=...)`) for a format asked for again, each with a lexer of
    its own, and rows copy them in turn."""

    format: ResponseFormat
    key: str
    compile_seconds: float  # wall, the first (warming) mask included
    warnings: list[str]
    _protos: list[llg.LLMatcher]
    grammar: str = ""  # what the engine compiled (llguidance's grammar text)
    _turn: Any = field(default_factory=itertools.count)
    _growing: bool = False  # more originals are being built (or have been)

    @property
    def lexers(self) -> int:
        return len(self._protos)

    def matcher(self) -> Matcher:
        protos = self._protos
        return Matcher(protos[next(self._turn) % len(protos)].deep_copy())

    def replay(self, tokens: Sequence[int]) -> Matcher:
        """A matcher advanced over these generated tokens (its state rebuilt)."""
        m = self.matcher()
        if tokens and not m.accept(tokens):
            raise GrammarError(f"replay failed: {m.error}")
        return m


class Matcher:
    """A row's grammar state. One thread touches it at a time (the engine core's loop thread;
    a batch's masks are filled on the engine's threads while the loop thread waits)."""

    __slots__ = ("_m", "tokens")

    def __init__(self, m: llg.LLMatcher) -> None:
        self._m = m
        self.tokens: list[int] = []  # consumed, in order

    def fill_mask(self, out_row: np.ndarray) -> None:
        """The next token's bitmask into a contiguous int32 row of ceil(V / 32) words (the GIL
        is released meanwhile). In an error state only EOS is allowed."""
        self._m.unsafe_compute_mask_ptr(out_row.ctypes.data, out_row.nbytes)

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of these tokens (a draft) the grammar accepts in order; no state change."""
        return self._m.validate_tokens([int(t) for t in token_ids])

    def accept(self, token_ids: int | Sequence[int]) -> bool:
        """Advance over sampled tokens. False, and an error state that rollback does not clear,
        if one is not allowed: a draft is checked with `validate` first."""
        ids = [int(token_ids)] if isinstance(token_ids, int | np.integer) else list(token_ids)
        ok = self._m.consume_tokens(ids)
        if ok:
            self.tokens.extend(ids)
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if n <= 0:
            return
        if n > len(self.tokens) or not self._m.rollback(n):
            raise GrammarError(f"cannot roll back {n} tokens: {self.error or 'too many'}")
        del self.tokens[-n:]

    def is_accepting(self) -> bool:
        """The output so far is a complete document: EOS is allowed now."""
        return self._m.is_accepting()

    def is_terminated(self) -> bool:
        """Nothing but EOS may follow: the document is complete and cannot grow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return _clean(self._m.get_error()) if self._m.is_error() else ""

    def copy(self) -> Matcher:
        twin = Matcher(self._m.deep_copy())
        twin.tokens = list(self.tokens)
        return twin


_executor_lock = threading.Lock()
_executor: llg.LLExecutor | None = None


def mask_threads() -> int:
    """The threads of llguidance's pool for batch masks: its own default (80% of the CPUs this
    process may run on, up to 32)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(32, int(0.8 * cpus)))


def mask_executor() -> llg.LLExecutor:
    """llguidance's thread pool for batch masks (one per process)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llg.LLExecutor(mask_threads())
        return _executor


def fill_masks(matchers: Sequence[Matcher], rows: Sequence[int], bitmask: np.ndarray) -> None:
    """Many rows' masks into bitmask[rows[i]] at once, on the engine's threads with the GIL
    released. Rows not named keep what they hold."""
    if not matchers:
        return
    batch, words = bitmask.shape
    if len(matchers) == 1:
        matchers[0].fill_mask(bitmask[rows[0]])
        return
    mask_executor().unsafe_compute_mask_ptr(
        [(m._m, int(r)) for m, r in zip(matchers, rows)], bitmask.ctypes.data, words * 4, batch
    )


def consume_many(matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
    """Advance each matcher over its one sampled token, all at once on the engine's threads:
    `Matcher.accept` for many rows (False for a refused token, its matcher in error)."""
    if len(matchers) <= 1:
        return [m.accept(int(t)) for m, t in zip(matchers, tokens)]
    ok = mask_executor().consume_token_par([(m._m, int(t)) for m, t in zip(matchers, tokens)])
    for m, t, good in zip(matchers, tokens, ok):
        if good:
            m.tokens.append(int(t))
    return ok


_filler_lock = threading.Lock()
_filler: ThreadPoolExecutor | None = None


def fill_masks_later(
    matchers: Sequence[Matcher],
    rows: Sequence[int],
    bitmask: np.ndarray,
    clock: Callable[[], float] = time.perf_counter,
) -> Future[float]:
    """`fill_masks` started on a thread of its own (one per process), so that the caller can go
    on with other work meanwhile; nothing may touch these matchers or rows until it is done.
    The future holds the fill's own seconds by `clock`."""
    global _filler

    def fill() -> float:
        started = clock()
        fill_masks(matchers, rows, bitmask)
        return clock() - started

    with _filler_lock:
        if _filler is None:
            _filler = named_executor(1, "grammar-masks")
        return _filler.submit(fill)


def fill_masks_with_drafts(
    matchers: Sequence[Matcher],
    rows: Sequence[int],
    drafts: Sequence[Sequence[int]],
    bitmask: np.ndarray,
) -> None:
    """Speculative decoding: for a row with draft d1..dk, the k + 1 masks (before d1, after d1,
    ..., after dk) into rows r..r+k. Each draft must be valid (`Matcher.validate`); the
    matchers' states are unchanged afterwards (the engine rolls its trial back)."""
    batch, words = bitmask.shape
    mask_executor().unsafe_compute_mask_ptr_with_draft_token(
        [(m._m, int(r), [int(t) for t in d]) for m, r, d in zip(matchers, rows, drafts)],
        bitmask.ctypes.data,
        words * 4,
        batch,
    )


class CompileObserver(Protocol):
    """Told of each lookup and compile (the front end's metrics)."""

    def looked_up(self, kind: str, hit: bool) -> None: ...
    def compiled(self, kind: str, seconds: float, refusal: GrammarError | None) -> None: ...


@dataclass
class CacheStats:
    hits: int = 0  # a finished or running compile of the same format was found
    misses: int = 0
    refusals: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0


TokenizerSource = Callable[[], llg.LLTokenizer]


class GrammarCache:
    """Compiles each distinct format once and keeps it (LRU, `max_entries`), refusals too: a bad
    format is refused again at once. Thread-safe; concurrent requests for one format share its
    compile. Compiles run on the cache's own threads, never on the caller's: an asyncio loop
    awaits `asyncio.wrap_future(cache.submit(fmt))`.

    Time: the engine call cannot be interrupted, so the compile's fuel is scaled to
    `max_compile_ms` (the engine stops itself), a watcher fails the future with a timeout
    refusal once the budget has passed (the late result is dropped), and a compile that
    finished over budget is refused too. Memory: each compiled grammar is bounded by the
    engine's limits (lexer states, grammar size) and the cache by its entries."""

    def __init__(
        self,
        tokenizer: TokenizerSource,
        *,
        max_compile_ms: float = 2000.0,
        max_entries: int = 256,
        compile_threads: int = 1,
        json_options: dict[str, Any] | None = None,
        observer: CompileObserver | None = None,
        lexers: int = 1,
    ) -> None:
        """`tokenizer`: makes the engine's tokenizer, on the first compile (a compile thread
        pays for it, outside the time budget). `lexers`: originals per compiled format that
        rows copy in turn (see `Compiled`). Past the first, they are built once the format is
        asked for again (a format used once costs one compile, as it would without them), on a
        thread of their own, so they add nothing to a compile's time."""
        self._tokenizer_source = tokenizer
        self._tokenizer: llg.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.max_compile_ms = float(max_compile_ms)
        self.max_entries = int(max_entries)
        self.json_options = dict(DEFAULT_JSON_OPTIONS if json_options is None else json_options)
        self._observer = observer
        fuel = max(_MIN_INITIAL_FUEL, int(_FUEL_PER_MS * self.max_compile_ms))
        self._limits = llg.LLParserLimits(initial_lexer_fuel=fuel, verbose_errors=False)
        self._pool = named_executor(compile_threads, "grammar-compile")
        self.lexers = max(1, int(lexers))
        self._lexer_pool = named_executor(1, "grammar-lexers")
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Compiled | GrammarError] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._asked_again: set[str] = set()  # compiling, and asked for meanwhile
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._done)

    def submit(self, fmt: ResponseFormat) -> Future:
        """A Future of the Compiled format (or raising GrammarError), resolved within about
        max_compile_ms of its compile starting."""
        key = format_key(fmt)
        start = False
        with self._lock:
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
                self.stats.hits += 1
                future: Future = Future()
                if isinstance(hit, GrammarError):
                    future.set_exception(hit)
                else:
                    future.set_result(hit)
                    self._grow(hit)
            elif key in self._pending:
                self.stats.hits += 1
                future = self._pending[key]
                self._asked_again.add(key)
            else:
                self.stats.misses += 1
                future = self._pending[key] = Future()
                start = True
        if self._observer is not None:
            self._observer.looked_up(fmt.kind, not start)
        if start:
            started = threading.Event()
            inner = self._pool.submit(self._build, fmt, key, started)
            threading.Thread(
                target=self._watch,
                args=(fmt, key, inner, started, future),
                daemon=True,
                name="grammar-watch",
            ).start()
        return future

    def compile(self, fmt: ResponseFormat) -> Compiled:
        """Blocking (cached) compile, for a caller that may wait. Raises GrammarError."""
        return self.submit(fmt).result()

    def tokenizer(self) -> llg.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_source()
            return self._tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lexer_pool.shutdown(wait=False, cancel_futures=True)

    def _watch(
        self,
        fmt: ResponseFormat,
        key: str,
        inner: Future,
        started: threading.Event,
        outer: Future,
    ) -> None:
        # The deadline is kept here: past it the caller is refused at once; the compile runs on
        # in the background (bounded by the engine's fuel) and its result is dropped.
        started.wait()
        begun = time.perf_counter()
        try:
            result: Compiled | GrammarError = inner.result(timeout=self.max_compile_ms / 1000)
        except FutureTimeoutError:
            result = GrammarError(
                f"compiling the format took longer than {self.max_compile_ms:g} ms "
                "(--max-grammar-compile-ms)",
                TIMEOUT,
            )
        except GrammarError as exc:
            result = exc
        except Exception as exc:  # an engine bug: still a refusal that says what happened
            result = GrammarError(f"the grammar engine failed on this format: {exc!r}")
        seconds = (
            result.compile_seconds if isinstance(result, Compiled) else time.perf_counter() - begun
        )
        with self._lock:
            self._pending.pop(key, None)
            if key in self._asked_again and isinstance(result, Compiled):
                self._grow(result)
            self._asked_again.discard(key)
            self._done[key] = result
            self._done.move_to_end(key)
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)
            self.stats.compile_seconds += seconds
            if isinstance(result, GrammarError):
                self.stats.refusals += 1
                self.stats.timeouts += result.code == TIMEOUT
        if self._observer is not None:
            refusal = result if isinstance(result, GrammarError) else None
            self._observer.compiled(fmt.kind, seconds, refusal)
        if isinstance(result, GrammarError):
            outer.set_exception(result)
        else:
            outer.set_result(result)

    def _grow(self, compiled: Compiled) -> None:
        """Start building a format's other originals (once; under the lock)."""
        if self.lexers > 1 and not compiled._growing:
            compiled._growing = True
            with contextlib.suppress(RuntimeError):  # closed: copies share the first original
                self._lexer_pool.submit(self._add_lexers, compiled)

    def _add_lexers(self, compiled: Compiled) -> None:
        """More originals of a compiled format, each with its own lexer, warmed by a first mask
        as the first was (the constructor runs with the GIL released)."""
        tokenizer = self.tokenizer()
        scratch = np.empty(mask_words(tokenizer.vocab_size), dtype=np.int32)
        while compiled.lexers < self.lexers:
            proto = self._original(tokenizer, compiled.grammar, scratch)
            if proto.is_error():  # the first compiled and masked alike: not expected
                log.warning(
                    "an extra lexer failed", kind=compiled.format.kind, error=proto.get_error()
                )
                return
            compiled._protos.append(proto)

    def _original(
        self, tokenizer: llg.LLTokenizer, grammar: str, scratch: np.ndarray
    ) -> llg.LLMatcher:
        """A matcher of this grammar that rows copy. The constructor compiles the grammar and
        builds its lexer with the GIL released (an error leaves the matcher in an error state
        rather than raising); its first mask, into `scratch`, warms the lexer its copies
        share."""
        proto = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if not proto.is_error():
            proto.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        return proto

    def _build(self, fmt: ResponseFormat, key: str, started: threading.Event) -> Compiled:
        tokenizer = self.tokenizer()  # outside the budget: once per process
        started.set()
        begun = time.perf_counter()
        size = len(fmt.text.encode("utf-8")) + sum(len(o.encode("utf-8")) for o in fmt.options)
        if size > MAX_FORMAT_BYTES:
            raise GrammarError(
                f"the format is {size} bytes; the limit is {MAX_FORMAT_BYTES}", TOO_COMPLEX
            )
        grammar = to_llguidance_grammar(fmt, self.json_options)
        scratch = np.empty(mask_words(tokenizer.vocab_size), dtype=np.int32)
        proto = self._original(tokenizer, grammar, scratch)
        if proto.is_error():
            raise engine_refusal(fmt, proto.get_error())
        # The first mask also catches a grammar that allows no first token.
        if not scratch.any():
            raise GrammarError(f"{fmt.kind}: no token can start an output", UNSUPPORTED)
        seconds = time.perf_counter() - begun
        if seconds * 1000 > self.max_compile_ms:
            raise GrammarError(
                f"compiling the format took {seconds * 1000:.0f} ms, over the "
                f"{self.max_compile_ms:g} ms limit (--max-grammar-compile-ms)",
                TIMEOUT,
            )
        warnings = list(proto.get_grammar_warnings())
        return Compiled(fmt, key, seconds, warnings, [proto], grammar)


def cache_for(
    tokenizer: Tokenizer,
    vocab_size: int,
    config: StructuredOutputConfig,
    *,
    compile_threads: int = 1,
    observer: CompileObserver | None = None,
    lexers: int = 1,
) -> GrammarCache | None:
    """The compile cache of response formats over this tokenizer (the engine's view of it is
    built on the first compile), or None when the tokenizer cannot drive the engine: no
    `tokenizer.json`, or no EOS (a grammar needs one to end). The core and the front ends build
    theirs alike, so a format compiles in one exactly when it compiles in the other. `lexers`:
    see `GrammarCache` (the core, which fills masks in parallel, wants one per mask thread)."""
    text = tokenizer.tokenizer_json()
    eos = sorted(tokenizer.eos_token_ids)
    if text is None or not eos:
        return None
    return GrammarCache(
        lambda: make_tokenizer(text, eos, vocab_size),
        max_compile_ms=config.max_grammar_compile_ms,
        max_entries=config.grammar_cache_size,
        compile_threads=compile_threads,
        observer=observer,
        lexers=lexers,
    )
