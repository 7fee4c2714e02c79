"""The `n` choices of one request: a generation each, run at once, the prompt prefilled once.

Choice 0 is the request as it would run alone. On a route of this node alone the other
choices wait until choice 0 has prefilled the prompt, then open with a copy of its caches
(`GenerationRequest.share`) and prefill only the prompt's last token. A distributed route
holds no copyable caches, so there every choice prefills (batched on each stage).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TypeVar

from swarmd.model.sampling import choice_seed
from swarmd.pipeline.coordinator import Coordinator
from swarmd.pipeline.generation import Generation, GenerationRequest, Timing

T = TypeVar("T")


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """Choice i's request: its own session id and seed; choices past 0 may share 0's caches."""
    out = [request]
    for index in range(1, n):
        sampling = replace(request.sampling, seed=choice_seed(request.sampling.seed, index))
        out.append(
            replace(
                request,
                request_id=f"{request.request_id}-{index}",
                sampling=sampling,
                share=request.request_id,
            )
        )
    return out


class Choices:
    """Opens each choice's generation; `generation(i)` is `Coordinator.generation` for it."""

    def __init__(
        self,
        coordinator: Coordinator,
        requests: list[GenerationRequest],
        timing: Timing,
        client_gone: Callable[[], bool],
    ) -> None:
        self.requests = requests
        self._coordinator = coordinator
        self._timing = timing
        self._client_gone = client_gone
        self._prefilled = asyncio.Event()  # choice 0's prompt is in the caches (or never will be)
        # Only a one-node route copies caches: elsewhere waiting would only delay the rest.
        whole = coordinator.routed(requests[0].model_id).is_whole
        self._wait = whole and len(requests) > 1

    @property
    def n(self) -> int:
        return len(self.requests)

    @asynccontextmanager
    async def generation(self, index: int) -> AsyncIterator[Generation]:
        first = index == 0
        if not first and self._wait:
            await self._prefilled.wait()
        # Every choice's timing counts from the request's receipt.
        timing = self._timing if first else Timing(received=self._timing.received)
        try:
            async with self._coordinator.generation(
                self.requests[index],
                timing,
                self._client_gone,
                self._prefilled.set if first else None,
            ) as gen:
                yield gen
        finally:
            if first:
                self._prefilled.set()  # failed before its prefill: the rest prefill alone


async def run_all(jobs: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Each job's result, in order; the first to fail cancels the rest and its error is
    raised (not a group: the API answers it as it would answer one request's)."""
    if len(jobs) == 1:
        return [await jobs[0]()]
    tasks = [asyncio.ensure_future(job()) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # also when this request itself is cancelled (the client left)
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc
    return [task.result() for task in tasks]
