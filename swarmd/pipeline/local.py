"""`LocalChain`: the route of one hop, this node's own torch worker holding every layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmd.errors import InternalError
from swarmd.model.jobs import CloseJob, OpenJob, StepJob
from swarmd.model.sampling import Sampled, SamplingParams
from swarmd.model.worker import TorchWorker
from swarmd.pipeline.chain import Hop


class LocalChain:
    """A route of one hop: this node runs every layer on its torch worker."""

    def __init__(self, worker: TorchWorker, hop: Hop, step_timeout_s: float) -> None:
        self.hops = [hop]
        self.failovers = 0
        self._worker = worker
        self._timeout_s = step_timeout_s
        self._session_id: str | None = None
        self._compute_s = 0.0

    @property
    def is_local(self) -> bool:
        return True

    async def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams,
        prompt: list[int],
        share: str | None = None,
    ) -> int:
        # Set before the await: if the caller times out or leaves while the worker opens
        # it, close() still frees it (an open not started by then is skipped, and one
        # running ends before the close, queued after it, runs).
        self._session_id = session_id
        job = OpenJob(session_id, max_length, sampling, prompt=tuple(prompt), share=share)
        return int(await self._worker.run(job, self._timeout_s))

    async def step(self, token_ids: list[int], want_token: bool) -> Sampled | None:
        session_id = self._session_id
        if session_id is None:
            raise InternalError("step() before open()")
        inputs = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
        result = await self._worker.run(StepJob(session_id, inputs, want_token), self._timeout_s)
        self._compute_s += result.compute_s
        return None if result.token is None else Sampled(result.token, result.logprobs)

    async def prefill(self, chunks: list[list[int]], before_each: Callable[[], None]) -> Sampled:
        token: Sampled | None = None
        for i, chunk in enumerate(chunks):
            before_each()
            token = await self.step(chunk, want_token=i == len(chunks) - 1)
        if token is None:
            raise InternalError("prefill produced no token")
        return token

    async def close(self) -> None:
        session_id, self._session_id = self._session_id, None
        if session_id is not None:
            await self._worker.run(CloseJob(session_id), self._timeout_s)

    def stage_seconds(self) -> list[float]:
        return [self._compute_s]

    def activation_bytes(self) -> int:
        return 0  # nothing leaves the process
