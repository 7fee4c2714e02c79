"""Sampling: turning the last stage's logits into the next token.

Each filter is a small pure function over a [V] float32 logits vector; `Sampler` applies
them in the order transformers does (penalties, temperature, top_k, top_p, min_p) and
draws with its own seeded generator, so a request with a `seed` is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens with this much probability
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties: logit -= frequency * count + presence * (count > 0)."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if not bias:
        return logits
    out = logits.clone()
    for token, value in bias.items():
        out[token] += value
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach p; the top token always stays.
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


class Sampler:
    """Per-session sampling state: parameters, a seeded generator, token counts."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.params = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def observe(self, token: int) -> None:
        """Count a token of the reply (for the penalties); also used when replaying."""
        self.counts[token] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 of the last position. Returns the chosen token id."""
        p = self.params
        logits = apply_penalties(logits, self.counts, p.presence_penalty, p.frequency_penalty)
        logits = apply_logit_bias(logits, p.logit_bias)
        if p.greedy:
            token = int(torch.argmax(logits))
        else:
            # Shift before dividing: with a tiny temperature the top logit stays 0 and the
            # others go to -inf instead of overflowing into inf - inf = NaN.
            logits = (logits - logits.max()) / p.temperature
            logits = top_k_filter(logits, p.top_k)
            logits = top_p_filter(logits, p.top_p)
            logits = min_p_filter(logits, p.min_p)
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.observe(token)
        return token
