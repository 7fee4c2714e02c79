"""The generation loop over a stand-in chain: the next step computes while a token's text
goes out, and a caller that stops reading leaves no step running behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmd.errors import ClientDisconnectedError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import Sampled, SamplingParams
from swarmd.model.text import TextCodec
from swarmd.pipeline.chain import Hop
from swarmd.pipeline.generation import Generation, GenerationRequest, Timing

WORDS = " one two three four five six seven eight nine ten"


class StandInChain:
    """Draws the given tokens in order; a step may be held until `release` is set."""

    failovers = 0
    is_local = True

    def __init__(self, tokens: list[int], hold_from: int | None = None) -> None:
        self.hops = [Hop("standin1", LayerRange(0, 1))]
        self._tokens = iter(tokens)
        self.steps_started = 0
        self.steps_cancelled = 0
        self._hold_from = hold_from
        self.release = asyncio.Event()

    async def open(self, *args: object, **kwargs: object) -> int:
        return 0

    async def prefill(self, chunks: list[list[int]], before_each: Callable[[], None]) -> Sampled:
        before_each()
        return Sampled(next(self._tokens))

    async def step(self, token_ids: list[int], want_token: bool) -> Sampled:
        self.steps_started += 1
        try:
            if self._hold_from is not None and self.steps_started >= self._hold_from:
                await self.release.wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.steps_cancelled += 1
            raise
        return Sampled(next(self._tokens))

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec.load(smollm_dir)


def generation(codec: TextCodec, chain: StandInChain, max_tokens: int) -> Generation:
    request = GenerationRequest(
        "req-1", "model", [1, 2, 3], max_tokens, SamplingParams(temperature=0.0)
    )
    return Generation(request, chain, codec, 64, Timing())  # type: ignore[arg-type]


async def test_the_next_step_runs_while_a_token_text_goes_out(codec: TextCodec) -> None:
    tokens = codec.tokenizer.encode(WORDS, add_special_tokens=False).ids
    chain = StandInChain(tokens)
    gen = generation(codec, chain, max_tokens=len(tokens))
    seen: list[str] = []
    started_at_delta: list[int] = []
    async for delta in gen.events():
        await asyncio.sleep(0)  # what writing the delta to a client does: yield the loop
        seen.append(delta.text)
        started_at_delta.append(chain.steps_started)
    assert "".join(seen) == WORDS
    assert gen.finish_reason == "length" and gen.tokens == tokens
    # While the k-th token's text was written, step k (which draws token k + 1) ran; none
    # was started past the last token.
    assert started_at_delta[:3] == [1, 2, 3]
    assert chain.steps_started == len(tokens) - 1


async def test_a_caller_that_stops_reading_leaves_no_step_running(codec: TextCodec) -> None:
    tokens = codec.tokenizer.encode(WORDS, add_special_tokens=False).ids
    chain = StandInChain(tokens, hold_from=3)  # the third step waits until released
    gen = generation(codec, chain, max_tokens=len(tokens))
    events = gen.events()
    got = [await anext(events) for _ in range(3)]
    assert "".join(d.text for d in got) == " one two three"
    await asyncio.sleep(0)
    assert chain.steps_started == 3  # held, in flight
    await events.aclose()  # the client left
    assert chain.steps_cancelled == 1
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_a_caller_that_fails_between_deltas_has_its_step_stopped_by_the_owner(
    codec: TextCodec,
) -> None:
    """A failed write leaves `events()` suspended at a delta with the next step running;
    the chain's owner settles the generation before it closes the chain."""
    tokens = codec.tokenizer.encode(WORDS, add_special_tokens=False).ids
    chain = StandInChain(tokens, hold_from=2)
    gen = generation(codec, chain, max_tokens=len(tokens))
    with pytest.raises(ConnectionResetError):
        async for delta in gen.events():
            await asyncio.sleep(0)
            if delta.text == " two":
                raise ConnectionResetError("the client went away mid-write")
    assert chain.steps_started == 2  # the step after " two" is running
    await gen.settle()
    assert chain.steps_cancelled == 1
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_a_client_gone_while_its_text_went_out_stops_the_reply(codec: TextCodec) -> None:
    tokens = codec.tokenizer.encode(WORDS, add_special_tokens=False).ids
    chain = StandInChain(tokens, hold_from=1)
    gone = False
    request = GenerationRequest(
        "req-1", "model", [1, 2, 3], len(tokens), SamplingParams(temperature=0.0)
    )
    gen = Generation(request, chain, codec, 64, Timing(), lambda: gone)  # type: ignore[arg-type]
    seen = []
    with pytest.raises(ClientDisconnectedError):
        async for delta in gen.events():
            await asyncio.sleep(0)  # the write; the next step starts meanwhile
            seen.append(delta.text)
            gone = True  # noticed once this delta is out: no wait for the step in flight
    assert seen == [" one"]
    assert chain.steps_started == 1 and chain.steps_cancelled == 1


class SlowPrefillChain(StandInChain):
    """A prompt's forwards that take longer than the test waits (a busy route)."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.prefill_cancelled = asyncio.Event()

    async def prefill(self, chunks: list[list[int]], before_each: Callable[[], None]) -> Sampled:
        before_each()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.prefill_cancelled.set()
            raise
        return Sampled(next(self._tokens))


async def test_a_client_that_leaves_during_a_long_prefill_stops_it_at_once(
    codec: TextCodec,
) -> None:
    """The check before each chunk cannot see a client that leaves while one chunk takes
    many seconds on a busy route: the prefill is watched and cancelled within
    GONE_CHECK_S, so the chain's owner frees every stage's session then."""
    chain = SlowPrefillChain([5])
    gone = False
    request = GenerationRequest("req-1", "model", [1, 2, 3], 8, SamplingParams(temperature=0.0))
    gen = Generation(request, chain, codec, 64, Timing(), client_gone=lambda: gone)  # type: ignore[arg-type]
    events = gen.events()
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.1)
    assert not first.done()  # the prompt's forward is running
    gone = True
    with pytest.raises(ClientDisconnectedError):
        await asyncio.wait_for(first, 5.0)
    assert chain.prefill_cancelled.is_set()
