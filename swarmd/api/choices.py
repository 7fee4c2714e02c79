"""The choices of one request: `n` per prompt (a /v1/completions request may send several
prompts), a generation each, run at once, each prompt prefilled once.

A prompt's choice 0 is that prompt's request as it would run alone. On a route of this
node alone the prompt's other choices wait until its choice 0 has prefilled it, then open
with a copy of its caches (`GenerationRequest.share`) and prefill only the prompt's last
token. A distributed route holds no copyable caches, so there every choice prefills
(batched on each stage). Choices are numbered through: prompt p's choice j is index
p * n + j, as OpenAI numbers them.
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


def choice_requests(prompts: list[GenerationRequest], n: int) -> list[list[GenerationRequest]]:
    """Each prompt's `n` choices: their own session ids (the request's id for index 0,
    `<id>-<index>` after) and seeds (choice j of every prompt draws with seed j's); a
    prompt's choices past 0 may share its choice 0's caches. `prompts` carry the
    request's id."""
    groups: list[list[GenerationRequest]] = []
    for p, request in enumerate(prompts):
        base = request.request_id
        lead_id = base if p == 0 else f"{base}-{p * n}"
        lead = replace(request, request_id=lead_id)
        group = [lead]
        for j in range(1, n):
            sampling = replace(request.sampling, seed=choice_seed(request.sampling.seed, j))
            group.append(
                replace(
                    request,
                    request_id=f"{base}-{p * n + j}",
                    sampling=sampling,
                    share=lead_id,
                )
            )
        groups.append(group)
    return groups


class Choices:
    """Opens each choice's generation; `generation(i)` is `Coordinator.generation` for it."""

    def __init__(
        self,
        coordinator: Coordinator,
        groups: list[list[GenerationRequest]],
        timing: Timing,
        client_gone: Callable[[], bool],
    ) -> None:
        self.requests = [request for group in groups for request in group]
        self.per_prompt = len(groups[0])
        self._coordinator = coordinator
        self._timing = timing
        self._client_gone = client_gone
        # Per prompt: its choice 0's prompt is in the caches (or never will be).
        self._prefilled = [asyncio.Event() for _ in groups]
        # Only a one-node route copies caches: elsewhere waiting would only delay the rest.
        whole = coordinator.routed(self.requests[0].model_id).is_whole
        self._wait = whole and self.per_prompt > 1

    @property
    def n(self) -> int:
        return len(self.requests)

    @asynccontextmanager
    async def generation(self, index: int) -> AsyncIterator[Generation]:
        prompt, choice = divmod(index, self.per_prompt)
        lead = choice == 0
        prefilled = self._prefilled[prompt]
        if not lead and self._wait:
            await prefilled.wait()
        # Every choice's timing counts from the request's receipt.
        timing = self._timing if index == 0 else Timing(received=self._timing.received)
        try:
            async with self._coordinator.generation(
                self.requests[index],
                timing,
                self._client_gone,
                prefilled.set if lead else None,
            ) as gen:
                yield gen
        finally:
            if lead:
                prefilled.set()  # failed before its prefill: the rest prefill alone


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
