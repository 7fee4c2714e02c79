"""Waiting for a torch worker job from trio (the stage service's side).

The worker calls `wake` on its own thread; trio's token hands the wake-up to the trio
run (in the trio thread), so a stage step never passes through asyncio.
"""

from __future__ import annotations

import contextlib
from typing import Any

import trio

from swarmd.errors import StepTimeoutError
from swarmd.model.worker import Job, TorchWorker


async def run_job(worker: TorchWorker, job: Job, timeout_s: float) -> Any:
    """Run a job from trio and return its result (or raise its error)."""
    here = worker.run_here(job)
    if here is not None:
        await trio.lowlevel.checkpoint()  # a checkpoint, as awaiting the worker would be
        return here.outcome()
    token = trio.lowlevel.current_trio_token()
    # The job wakes its waiter once, when it ends (a memory channel costs more to make and
    # to wait on: this is on every step of every stage).
    ended = trio.Event()

    def wake() -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the run ended: nobody waits
            token.run_sync_soon(ended.set)

    ticket = worker.submit(job, wake)
    try:
        while not ticket.finished:
            left = ticket.time_left(timeout_s)
            if left <= 0:
                raise StepTimeoutError(f"A model step took longer than {timeout_s:g} s")
            with trio.move_on_after(left):
                await ended.wait()
    finally:
        ticket.cancel()
    return ticket.outcome()
