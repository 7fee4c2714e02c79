"""A distributed chain feeds each drawn token back itself (`FeedBack`), except the last.

The ring sends the step of a token the moment it arrives, instead of waiting for the
coordinator's loop to hand it back (issue 17: fewer crossings a token). A step is sent
ahead only when the caller will ask for it: never after end of sequence, never past the
reply's `max_tokens` (each such step would cost every stage a forward for nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest

from swarmd.model.sampling import Sampled, SamplingParams
from swarmd.pipeline import distributed, wire
from swarmd.pipeline.chain import FeedBack
from swarmd.pipeline.distributed import DistributedChain
from tests.unit.test_blame import RECORDS, SETTINGS, FakeSwarm, first_route

EOS = 2


class ScriptedRing:
    """Answers each step with the next token of a script; keeps what `ahead` asked for."""

    script: ClassVar[list[int]] = []
    made: ClassVar[list[ScriptedRing]] = []

    def __init__(self, *args: Any) -> None:
        self.tokens = iter(type(self).script)
        self.sent_ahead: list[list[int] | None] = []
        self.asked: list[list[int]] = []
        self.reused = 0
        self.round_trip_s = 0.001
        self.sid = "s.1"
        type(self).made.append(self)

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def steps(
        self,
        steps: Sequence[tuple[list[int], bool, bool]],
        window: int,
        before_send: Callable[[], None],
        replied: Callable[[wire.TokenReply], None],
        ahead: Callable[[wire.TokenReply], list[int] | None] | None = None,
    ) -> None:
        reply = None
        for ids, want, _ in steps:
            self.asked.append(list(ids))
            reply = wire.TokenReply(0, next(self.tokens) if want else None, (1.0,), 0, None)
            replied(reply)
        if ahead is not None and reply is not None:
            self.sent_ahead.append(ahead(reply))


def _reply(
    monkeypatch: pytest.MonkeyPatch, script: list[int], max_tokens: int
) -> tuple[list[int], ScriptedRing]:
    """Draw tokens as `Generation` does (prefill, then each token back until EOS or
    `max_tokens`) on a chain whose ring answers with `script`."""
    monkeypatch.setattr(ScriptedRing, "script", script)
    monkeypatch.setattr(ScriptedRing, "made", [])
    monkeypatch.setattr(distributed, "Ring", ScriptedRing)

    async def draw() -> list[int]:
        swarm = FakeSwarm()
        chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100)
        feed_back = FeedBack(frozenset({EOS}), max_tokens)
        await chain.open("r1", 64, SamplingParams(), [5, 6, 7], feed_back=feed_back)
        drawn: Sampled | None = await chain.prefill([[5, 6], [7]], lambda: None)
        tokens: list[int] = []
        while drawn is not None:
            tokens.append(drawn.token)
            if drawn.token == EOS or len(tokens) == max_tokens:
                break
            drawn = await chain.step([drawn.token], want_token=True)
        await chain.close()
        return tokens

    tokens = asyncio.run(draw())
    (ring,) = ScriptedRing.made
    return tokens, ring


def test_every_token_but_the_last_is_sent_ahead_up_to_max_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, ring = _reply(monkeypatch, [11, 12, 13, 14, 15], max_tokens=4)
    assert tokens == [11, 12, 13, 14]
    # the ring was asked for each token's step, and sent each ahead but the 4th's
    assert ring.asked == [[5, 6], [7], [11], [12], [13]]
    assert ring.sent_ahead == [[11], [12], [13], None]


def test_no_step_is_sent_ahead_after_end_of_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, ring = _reply(monkeypatch, [11, EOS, 13], max_tokens=10)
    assert tokens == [11, EOS]
    assert ring.sent_ahead == [[11], None]
