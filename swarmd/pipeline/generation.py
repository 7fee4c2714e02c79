"""One generation on a chain of stages: chunked prefill, then one token per step.

The loop is the coordinator's: it sends prompt chunks and tokens into the chain, turns
sampled tokens into text, cuts at stop strings and end-of-sequence, and keeps timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from swarmd.errors import ClientDisconnectedError, InternalError
from swarmd.model.sampling import Sampled, SamplingParams, TokenLogprobs
from swarmd.model.text import IncrementalDetokenizer, StopMatcher, TextCodec
from swarmd.pipeline import bounds
from swarmd.pipeline.admission import unless_gone
from swarmd.pipeline.chain import StageChain

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    model_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    # The request id of another reply to this prompt (a choice of `n`) whose prefilled
    # caches this one may copy, on a route that can.
    share: str | None = None


@dataclass(frozen=True)
class Delta:
    text: str
    # The logprobs of the tokens this text completes (when asked): a token whose text is
    # held back (it may begin a stop string) comes with the delta that releases it.
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()


@dataclass
class Timing:
    """Seconds of each phase; None until measured."""

    received: float = field(default_factory=time.perf_counter)
    queue_s: float | None = None
    sched_s: float | None = None
    ttft_s: float | None = None  # from receipt to the first token
    decode_s: float | None = None  # from the first token to the last
    total_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens

    def since_received(self) -> float:
        return time.perf_counter() - self.received


class Generation:
    """Drives one request through a chain; iterate `events()` once."""

    def __init__(
        self,
        request: GenerationRequest,
        chain: StageChain,
        codec: TextCodec,
        chunk: int,
        timing: Timing,
        client_gone: Callable[[], bool] = lambda: False,
        on_prefilled: Callable[[], None] | None = None,
    ) -> None:
        """`on_prefilled`: called once the prompt is in the caches (the first token drawn)."""
        self.request = request
        self._on_prefilled = on_prefilled
        self._client_gone = client_gone
        self.chain = chain
        self.timing = timing
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.cached_tokens = 0  # prompt tokens reused from a cached conversation
        self._step: asyncio.Future[Sampled] | None = None  # the next token's, in flight
        self._codec = codec
        # A step frame carries at most bounds.MAX_STEP_TOKENS: a larger configured chunk
        # would make every stage 0 take the coordinator's steps for garbage.
        self._chunk = max(1, min(chunk, bounds.MAX_STEP_TOKENS))

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    async def events(self) -> AsyncIterator[Delta]:
        """Text deltas; once exhausted, `finish_reason` and `tokens` tell how it ended."""
        req = self.request
        detok = IncrementalDetokenizer(self._codec)
        stops = StopMatcher(req.stop)
        max_length = len(req.prompt_ids) + req.max_tokens
        # The open and the prompt's forwards may take many seconds on a busy route: a
        # client that leaves meanwhile is noticed within GONE_CHECK_S, not at the next
        # chunk, so every stage frees the session at once.
        opening = self.chain.open(
            req.request_id, max_length, req.sampling, req.prompt_ids, req.share
        )
        self.cached_tokens = await unless_gone(opening, self._client_gone)
        drawn = await self._prefill()
        if self._on_prefilled is not None:
            self._on_prefilled()
        self.timing.ttft_s = self.timing.since_received()
        first_token_at = last_token_at = time.perf_counter()
        pending: list[tuple[int, TokenLogprobs]] = []
        while True:
            token = drawn.token
            self.tokens.append(token)
            if token in self._codec.eos_ids:
                self.finish_reason = "stop"
                break
            if drawn.logprobs is not None:
                pending.append((token, drawn.logprobs))
            text = stops.feed(detok.add(token))
            if stops.stopped or len(self.tokens) >= req.max_tokens:
                if text:
                    yield Delta(text, tuple(pending))
                    pending.clear()
                self.finish_reason = "stop" if stops.stopped else "length"
                break
            # The next step computes while this token's text goes out to the client: the
            # caller's work on a delta (an SSE write) is then off the per-token path.
            step = self._step = asyncio.ensure_future(self._decode_one_token(token))
            try:
                if text:
                    yield Delta(text, tuple(pending))
                    pending.clear()
                    self._stop_if_client_gone()  # a client gone while its text went out
                drawn = await step
            finally:
                await self.settle()
            now = time.perf_counter()
            self.timing.token_gaps_s.append(now - last_token_at)
            last_token_at = now
        self.timing.decode_s = time.perf_counter() - first_token_at
        tail = "" if stops.stopped else stops.feed(detok.flush()) + stops.flush()
        if tail or (pending and not stops.stopped):
            yield Delta(tail, tuple(pending))

    async def settle(self) -> None:
        """Cancel the step in flight, if any, and wait for it. The owner of the chain calls
        it before closing the chain: a caller that raised between two deltas (a failed
        write) leaves `events()` suspended, with the next step still running."""
        step, self._step = self._step, None
        if step is not None:
            await _settle(step)

    def _stop_if_client_gone(self) -> None:
        # Checked before every step and after each delta goes out, so a client that left
        # costs at most one more step (the one computing while its last text went out).
        if self._client_gone():
            raise ClientDisconnectedError("The client closed the connection")

    async def _prefill(self) -> Sampled:
        prompt = self.request.prompt_ids
        # The cached start of the prompt (a previous turn's) is already in the caches.
        chunks = [
            prompt[start : start + self._chunk]  # [<= chunk]
            for start in range(self.cached_tokens, len(prompt), self._chunk)
        ]
        if not chunks:
            raise InternalError("prefill produced no token")
        prefilled = self.chain.prefill(chunks, self._stop_if_client_gone)
        return await unless_gone(prefilled, self._client_gone)

    async def _decode_one_token(self, token: int) -> Sampled:
        self._stop_if_client_gone()
        nxt = await self.chain.step([token], want_token=True)
        if nxt is None:
            raise InternalError("decode step produced no token")
        return nxt


async def _settle(step: asyncio.Future[Sampled]) -> None:
    """A step left behind (the caller stopped reading, or failed) is cancelled and waited
    for, so it never outlives its generation; its own error was the caller's to see."""
    if not step.done():
        step.cancel()
        await asyncio.wait([step])  # raises only if this task itself is cancelled meanwhile
    if not step.cancelled():
        step.exception()  # retrieved: asyncio would log it as never retrieved
