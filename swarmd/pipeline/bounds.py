"""Every bound on what a request may ask, defined once (pure: no I/O).

The API validates a request body against this table (`swarmd.api.schemas` builds its
pydantic fields from it) and a stage checks the `open` frame the coordinator builds
against the same table (`swarmd.pipeline.wire`), so a request the API accepts is never a
frame a stage refuses: anything that passes the API passes the wire.

On the wire a value of the right type outside its bound is a *refusal* (the request
asked what this stage will not serve: the request fails with a 4xx, nobody is banned);
a value of the wrong type is garbage (`MalformedFrameError`, the sender is banned).

`top_k` is the one bound that normalises instead of refusing: a `top_k` of at least the
vocabulary keeps every token, which is what no top-k filtering does, so it travels as 0
(off) and a stage reads any `top_k` at or over its vocabulary the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class NumberBound:
    """A number a request may give, in `lo..hi` (`lo` itself out when `lo_open`)."""

    name: str  # the request parameter, as the client wrote it
    lo: float
    hi: float
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        if not math.isfinite(value) or value > self.hi:
            return False
        return value > self.lo if self.lo_open else value >= self.lo

    def describe(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


TEMPERATURE = NumberBound("temperature", 0.0, 2.0)
TOP_P = NumberBound("top_p", 0.0, 1.0, lo_open=True)  # 0 would keep no token at all
MIN_P = NumberBound("min_p", 0.0, 1.0)
PRESENCE_PENALTY = NumberBound("presence_penalty", -2.0, 2.0)
FREQUENCY_PENALTY = NumberBound("frequency_penalty", -2.0, 2.0)
LOGIT_BIAS_VALUE = NumberBound("logit_bias", -100.0, 100.0)
SAMPLING_NUMBERS = (TEMPERATURE, TOP_P, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY)

TOP_K_MIN = -1  # the API's lowest top_k: -1 and 0 both mean off (vLLM's extension)
TOP_K_OFF = 0  # how "no top-k filtering" travels on the wire
MAX_LOGIT_BIAS = 1024  # logit_bias entries one request may give (and one frame carries)
SEED_MIN = -(2**63)  # torch's seed range, which msgpack's 64-bit ints also carry
SEED_MAX = 2**64 - 1
MAX_STOP = 16  # stop sequences (the coordinator matches them; they never travel)
N_MAX = 8  # choices per request (`n`): each is a session of its own
PROMPTS_MAX = 32  # prompts in one /v1/completions request, times `n`: sessions of their own
MAX_CONTEXT_TOKENS = 10**7  # prompt + reply of one session: max_len, history, max_tokens
MAX_STEP_TOKENS = 1024  # tokens in one step frame: prefill is chunked to at most this

# The parameters a stage's refusal may name (a peer chooses the text, so only these).
PARAMS = frozenset(
    {
        *(b.name for b in SAMPLING_NUMBERS),
        "top_k",
        "logit_bias",
        "seed",
        "max_tokens",
        "messages",
        "prompt",
    }
)


def wire_top_k(top_k: int | None, vocab_size: int) -> int:
    """The `top_k` a request's value travels as: off (0) for none, -1, 0, or >= vocab."""
    if top_k is None or top_k <= TOP_K_OFF or top_k >= vocab_size:
        return TOP_K_OFF
    return top_k


def seed_holds(seed: int) -> bool:
    return SEED_MIN <= seed <= SEED_MAX
