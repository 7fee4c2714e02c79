"""Sampling: turning the last stage's logits into the next token.

Each filter is a small pure function over a [V] float32 logits vector; `Sampler` applies
them in the order transformers does (penalties, a grammar's mask, temperature, top_k,
top_p, min_p).

A draw depends on (seed, position in the reply) only: the generator of each token is
seeded from those two. So a reply with a `seed` is the same alone or batched, and across
a failover, whose new last stage is told the reply so far (`observe`) and then draws
exactly what the lost one would have. A session without a seed gets a random one.

`logprobs` come from the distribution the token was drawn from: after penalties, bias,
the grammar's mask, temperature and the filters (a greedy pick reads the distribution at
temperature 1, unfiltered). A token it rules out has the logprob `IMPOSSIBLE` (OpenAI's
-9999.0), never -inf, which JSON cannot carry.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarmd.model.grammar import GrammarSpec

IMPOSSIBLE = -9999.0  # the logprob of a token the distribution rules out
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
_MASK64 = (1 << 64) - 1


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
    # None: no logprobs; n: the drawn token's logprob and the n likeliest tokens'.
    top_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # the reply must match it (constrained decoding)

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


class Constraint(Protocol):
    """A grammar's state for one reply (`swarmd.model.grammar.Constraint`)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the drawn token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), likeliest first


@dataclass(frozen=True)
class Sampled:
    token: int
    logprobs: TokenLogprobs | None = None  # when the session asked for them


def random_seed() -> int:
    return random.SystemRandom().getrandbits(63)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at `position` of a reply (splitmix64 of both)."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_CHOICE_SALT = 0x636F_6963_655F_6E00  # "choice_n": choice seeds never meet draw seeds


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (`n` > 1): choice 0 keeps the
    seed, so it is the reply the request would get alone; the others are their own draws."""
    if index == 0:
        return seed
    return draw_seed(seed ^ _CHOICE_SALT, index) >> 1  # 63 bits: any stage's seed range


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
