"""What a benchmark sends: the prompts, the lengths, and the load pattern.

A `Workload` is the recipe (options); `build_plan` turns it into a `Plan`: the exact list of
requests of every level (prompt text, max_tokens, send time), built once and given unchanged to
every target, so ours and the peers are measured on the identical workload.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from client.bench.metrics import LevelKey

# Varied user questions so the batch is not one prompt repeated (prefix caching and
# identical rows would flatter the numbers); lengths differ a little, as in real traffic.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.",
    "List three benefits of regular exercise.",
    "How does a rainbow form?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a virus and a bacterium?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers? Give some examples.",
    "How do airplanes stay in the air?",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a weekend camping trip?",
    "Explain what a computer program is to a child.",
    "What causes the seasons on Earth?",
)

# Filler appended to a question to reach a target prompt length: plain English words,
# mostly one token each in byte-level BPE vocabularies.
FILLER_TEXT = (
    "Please take into account the following background notes while you answer the question "
    "above in a clear and friendly way for a general reader who is curious about the world "
    "and likes short examples drawn from daily life such as cooking walking reading and "
    "talking with friends about science history music art sport travel weather animals "
    "plants cities rivers mountains oceans stars planets machines tools games books films "
    "and the many small things that make an ordinary day interesting to think about again"
)
FILLER = FILLER_TEXT.split()

ARRIVALS = ("burst", "closed", "poisson")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed:N` or `uniform:A-B` (inclusive); a bare N is fixed."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        if isinstance(text, int):
            return cls(text, text)
        spec = text.strip().lower()
        match = re.fullmatch(r"(?:fixed:)?(\d+)", spec)
        if match:
            n = int(match.group(1))
            return cls(n, n)
        match = re.fullmatch(r"uniform:(\d+)-(\d+)", spec)
        if match and int(match.group(1)) <= int(match.group(2)):
            return cls(int(match.group(1)), int(match.group(2)))
        raise ValueError(f"length {text!r}: expected N, fixed:N or uniform:A-B with A <= B")

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def sample(self, rng: random.Random) -> int:
        return self.low if self.fixed else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"fixed:{self.low}" if self.fixed else f"uniform:{self.low}-{self.high}"


@dataclass(frozen=True)
class Workload:
    """The recipe of a run.

    Arrival patterns, per level:
    - `burst` (closed loop, the default): `rounds` rounds of C requests started at once, each
      round waiting for all C (what the in-process batch peer can also run); at least
      `min_requests` requests a level (more rounds where C is small);
    - `closed`: C workers, each sending its next request when its previous one ends,
      `rounds * C` requests in all (C in flight at every moment);
    - `poisson` (open loop): requests sent at exponential inter-arrival times at each of
      `rates` (requests/s), for `duration` seconds or `num_requests` requests, whatever the
      replies do; the levels are then the rates, not concurrencies.
    Before the first level, `warmup` untimed requests; before each level, `warmup_rounds`
    untimed rounds of that level's shape (the first batch of a new size pays one-off costs:
    graph compilation, kernel JIT on a GPU).
    """

    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: str = "fixed:64"
    # None: the chat questions as they are; else each padded with filler to this many
    # prompt tokens (the rendered chat, as the server counts it).
    prompt_len: str | None = None
    rounds: int = 1
    # Burst/closed levels get more rounds when `rounds * C` is fewer requests than this: a level
    # of one or two requests (C=1) says little on a noisy host.
    min_requests: int = 0
    arrival: str = "burst"
    rates: tuple[float, ...] = ()
    duration: float | None = None
    num_requests: int | None = None
    warmup: int = 1
    warmup_rounds: int = 0
    seed: int = 0
    # Every request generates exactly max_tokens, so runs are comparable token for token.
    ignore_eos: bool = True
    temperature: float = 0.0
    # None leaves the server's prompt-prefix cache setting alone.
    cache_prompt: bool | None = None
    prompts: tuple[str, ...] = field(default=DEFAULT_PROMPTS)

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival {self.arrival!r}: choose one of {ARRIVALS}")
        LengthDist.parse(self.max_tokens)
        if self.prompt_len is not None:
            LengthDist.parse(self.prompt_len)
        if self.arrival == "poisson":
            if not self.rates or min(self.rates) <= 0:
                raise ValueError("--arrival poisson needs --rate R[,R...] > 0")
            if self.duration is None and self.num_requests is None:
                raise ValueError("--arrival poisson needs --duration S or --num-requests N")

    def prompts_for(self, concurrency: int, round_index: int) -> list[str]:
        """The questions of one round; every target gets the same ones for the same round."""
        start = (round_index * concurrency) % len(self.prompts)
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(concurrency)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        return cls(
            **{
                **data,
                "concurrency": tuple(data["concurrency"]),
                "rates": tuple(data.get("rates", ())),
                "prompts": tuple(data["prompts"]),
            }
        )


@dataclass
class RequestSpec:
    """One request of the plan: a single user chat turn."""

    prompt: str
    max_tokens: int
    # Poisson: seconds after the level's start at which it is sent (0 otherwise).
    at: float = 0.0
    # The rendered chat's token count as our server's Tokenize saw it (None: not counted).
    prompt_tokens: int | None = None


@dataclass
class LevelPlan(LevelKey):
    """One level: a concurrency (burst/closed) or a rate (poisson)."""

    arrival: str
    concurrency: int | None
    rate: float | None
    # burst: one list per round; closed and poisson: a single list.
    batches: list[list[RequestSpec]]
    warmup: list[list[RequestSpec]] = field(default_factory=list)

    @property
    def requests(self) -> list[RequestSpec]:
        return [spec for batch in self.batches for spec in batch]


@dataclass
class Plan:
    workload: Workload
    warmup: list[RequestSpec]
    levels: list[LevelPlan]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(),
            "warmup": [asdict(s) for s in self.warmup],
            "levels": [
                {
                    "arrival": lv.arrival,
                    "concurrency": lv.concurrency,
                    "rate": lv.rate,
                    "batches": [[asdict(s) for s in b] for b in lv.batches],
                    "warmup": [[asdict(s) for s in b] for b in lv.warmup],
                }
                for lv in self.levels
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        def specs(items: list[dict[str, Any]]) -> list[RequestSpec]:
            return [RequestSpec(**item) for item in items]

        return cls(
            workload=Workload.from_dict(data["workload"]),
            warmup=specs(data["warmup"]),
            levels=[
                LevelPlan(
                    arrival=lv["arrival"],
                    concurrency=lv["concurrency"],
                    rate=lv["rate"],
                    batches=[specs(b) for b in lv["batches"]],
                    warmup=[specs(b) for b in lv["warmup"]],
                )
                for lv in data["levels"]
            ],
        )


# Counts the prompt tokens of a single-user-turn chat (our server's Tokenize RPC).
TokenCounter = Callable[[str], int]


class PromptPadder:
    """Pads a question with filler words until its rendered chat has a target token count."""

    def __init__(self, count_tokens: TokenCounter) -> None:
        self.count_tokens = count_tokens
        self._cache: dict[tuple[str, int], tuple[str, int]] = {}
        self._counts: dict[str, int] = {}

    def count(self, text: str) -> int:
        if text not in self._counts:
            self._counts[text] = self.count_tokens(text)
        return self._counts[text]

    def pad(self, question: str, target: int) -> tuple[str, int]:
        """(text, its token count); the count equals target unless the question alone is longer."""
        key = (question, target)
        if key in self._cache:
            return self._cache[key]
        base = self.count(question)
        best = (question, base)
        words = max(target - base, 0)
        for _ in range(8):  # a few corrections: filler words are about one token each
            if words <= 0:
                break
            filler = " ".join(FILLER[i % len(FILLER)] for i in range(words))
            text = f"{question}\n\n{filler}"
            got = self.count(text)
            if abs(got - target) < abs(best[1] - target) or (got == best[1] and got <= target):
                best = (text, got)
            if got == target:
                break
            words += target - got
        self._cache[key] = best
        return best


def build_plan(workload: Workload, count_tokens: TokenCounter | None = None) -> Plan:
    """Materialize the workload's requests (seeded, so the same options give the same plan)."""
    rng = random.Random(workload.seed)
    out_dist = LengthDist.parse(workload.max_tokens)
    in_dist = LengthDist.parse(workload.prompt_len) if workload.prompt_len else None
    if in_dist is not None and count_tokens is None:
        raise ValueError("--prompt-len needs a token counter (our server's Tokenize)")
    padder = PromptPadder(count_tokens) if count_tokens else None
    question_index = 0

    def spec(question: str | None = None, at: float = 0.0) -> RequestSpec:
        nonlocal question_index
        if question is None:
            question = workload.prompts[question_index % len(workload.prompts)]
            question_index += 1
        max_tokens = out_dist.sample(rng)
        if in_dist is not None and padder is not None:
            text, tokens = padder.pad(question, in_dist.sample(rng))
            return RequestSpec(text, max_tokens, at, tokens)
        tokens = padder.count(question) if padder is not None else None
        return RequestSpec(question, max_tokens, at, tokens)

    warmup = [spec(workload.prompts[i % len(workload.prompts)]) for i in range(workload.warmup)]
    levels: list[LevelPlan] = []
    if workload.arrival == "poisson":
        for rate in workload.rates:
            # The first request goes at t=0; then exponential gaps, until N requests were
            # planned or the next arrival would fall after the duration.
            t = 0.0
            batch = []
            while True:
                batch.append(spec(at=t))
                t += rng.expovariate(rate)
                if workload.num_requests is not None:
                    if len(batch) >= workload.num_requests:
                        break
                elif t >= (workload.duration or 0.0):
                    break
            warm = (
                [[spec() for _ in range(workload.warmup_rounds)]] if workload.warmup_rounds else []
            )
            levels.append(LevelPlan("poisson", None, rate, [batch], warm))
        return Plan(workload, warmup, levels)

    for concurrency in workload.concurrency:
        warm = [
            [spec(q) for q in workload.prompts_for(concurrency, -1 - r)]
            for r in range(workload.warmup_rounds)
        ]
        num_rounds = max(workload.rounds, -(-workload.min_requests // concurrency))
        rounds = [
            [spec(q) for q in workload.prompts_for(concurrency, r)] for r in range(num_rounds)
        ]
        if workload.arrival == "closed":
            rounds = [[s for batch in rounds for s in batch]]
        levels.append(LevelPlan(workload.arrival, concurrency, None, rounds, warm))
    return Plan(workload, warmup, levels)
