"""Sampling parameters: plain data shared by the front ends (validation) and the engine core
(the sampler). No MLX here: the front-end processes import it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def fused_key(self) -> tuple[float, float, int, float]:
        """Rows with equal keys are sampled by one fused draw."""
        if self.greedy:
            return (0.0, 1.0, 0, 0.0)
        return (self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
