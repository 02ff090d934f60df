"""What a benchmark sends: the prompts, the lengths, and the load pattern."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class Workload:
    """A closed-loop concurrency sweep of chat requests.

    For each level C: one warm-up request, then `rounds` rounds of C requests started at
    once, each round waiting for all C to finish. (An open-loop arrival pattern, e.g.
    Poisson at a given rate, would be another field read by the runners.)
    """

    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: int = 64
    rounds: int = 1
    # Every request generates exactly max_tokens, so runs are comparable token for token.
    ignore_eos: bool = True
    temperature: float = 0.0
    # None leaves the server's prompt-prefix cache setting alone.
    cache_prompt: bool | None = None
    prompts: tuple[str, ...] = field(default=DEFAULT_PROMPTS)

    def prompts_for(self, concurrency: int, round_index: int) -> list[str]:
        """The prompts of one round; every target gets the same ones for the same round."""
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
                "prompts": tuple(data["prompts"]),
            }
        )
