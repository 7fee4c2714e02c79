"""Sampling parameters and what a draw yields: the parts a coordinator needs, no torch.

The torch side (the filters and `Sampler`, which turn the last stage's logits into the next
token) is `swarmd.model.sampler`; a node that holds no layers never imports it.

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

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from swarmd.model.grammar import GrammarSpec

if TYPE_CHECKING:
    import torch

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
