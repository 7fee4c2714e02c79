"""Sampling: turning the last stage's logits into the next token (torch).

Each filter is a small pure function over a [V] float32 logits vector; `Sampler` applies
them in the order transformers does (penalties, a grammar's mask, temperature, top_k,
top_p, min_p). The parameters, seeds and results are `swarmd.model.sampling` (no torch),
and the reasoning about seeds and logprobs is written there.
"""

from __future__ import annotations

import math

import torch

from swarmd.model.sampling import (
    IMPOSSIBLE,
    Constraint,
    Sampled,
    SamplingParams,
    TokenLogprobs,
    draw_seed,
    random_seed,
)


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


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The drawn token's logprob and the `top` likeliest, from the logits drawn from."""
    logprobs = torch.log_softmax(logits, dim=-1)
    pairs: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        pairs = tuple(
            (int(i), _finite(float(v))) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
        )
    return TokenLogprobs(_finite(float(logprobs[token])), pairs)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE


class Sampler:
    """Per-session sampling state: parameters, the reply's position, token counts and
    the grammar's state."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, constraint: Constraint | None = None
    ) -> None:
        self.params = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.seed = params.seed if params.seed is not None else random_seed()
        self.position = 0  # reply tokens so far
        self.constraint = constraint

    def observe(self, token: int) -> None:
        """A token of the reply (penalties, position, grammar); also used when replaying."""
        self.counts[token] += 1
        self.position += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 of the last position. Returns the chosen token id."""
        return self.draw(logits).token

    def draw(self, logits: torch.Tensor) -> Sampled:
        """logits: [V] float32 of the last position: the token, with logprobs if asked."""
        p = self.params
        logits = apply_penalties(logits, self.counts, p.presence_penalty, p.frequency_penalty)
        logits = apply_logit_bias(logits, p.logit_bias)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
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
            generator = torch.Generator().manual_seed(draw_seed(self.seed, self.position))
            token = int(torch.multinomial(probs, 1, generator=generator))
        logprobs = None
        if p.top_logprobs is not None:
            logprobs = token_logprobs(logits, token, p.top_logprobs)
        self.observe(token)
        return Sampled(token, logprobs)
