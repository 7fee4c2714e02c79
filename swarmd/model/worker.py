"""`TorchWorker`: the one thread that runs torch, fed by a queue.

Model compute never runs on the event loop. The GIL is released inside torch ops, so a
forward pass on this thread leaves the API and networking responsive. Every call has a
timeout, counted from the moment the worker starts the job (time in the queue is the
admission's business, not the step's). A job whose caller has gone away is skipped before
it starts, unless it must run (freeing a KV cache must happen whoever still waits).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarmd.errors import InternalError, StepTimeoutError, SwarmError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Job:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    started: asyncio.Future[None]
    must_run: bool


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller timed out or was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TorchWorker:
    def __init__(self, threads: int = 0, name: str = "swarmd-torch") -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._stopped = asyncio.get_running_loop().create_future()
        self._thread.start()

    async def call(self, fn: Callable[[], T], timeout_s: float, must_run: bool = False) -> T:
        """Run fn on the worker thread and return its result."""
        if self._stopped is None or self._stopped.done():
            raise InternalError("The torch worker is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        started: asyncio.Future[None] = loop.create_future()
        self._queue.put(_Job(fn, loop, future, started, must_run))
        try:
            await started
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError as exc:
            raise StepTimeoutError(f"A model step took longer than {timeout_s:g} s") from exc
        finally:
            if not future.done():
                future.cancel()  # tells the worker to skip it if it has not started

    async def stop(self) -> None:
        if self._stopped is None or not self._thread.is_alive():
            return
        self._queue.put(None)
        await self._stopped
        # The thread settles `_stopped` on its last line; joining only waits for its return.
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        loop = self._stopped.get_loop() if self._stopped is not None else None
        if self._threads > 0:
            torch.set_num_threads(self._threads)
        try:
            while (job := self._queue.get()) is not None:
                if job.future.done() and not job.must_run:
                    continue
                job.loop.call_soon_threadsafe(_settle, job.started, None, None)
                result: Any = None
                error: BaseException | None = None
                try:
                    result = job.fn()
                except SwarmError as exc:
                    error = exc
                except Exception as exc:  # a torch failure must reach the caller, typed
                    log.exception("model step failed")
                    error = InternalError(f"Model step failed: {type(exc).__name__}: {exc}")
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)
        finally:
            if loop is not None and self._stopped is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_settle, self._stopped, None, None)
