"""The torch worker: one thread, typed errors, a timeout on every call, a clean stop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from swarmd.errors import InternalError, ModelLoadError, StepTimeoutError
from swarmd.model.worker import TorchWorker


async def test_runs_jobs_on_its_own_thread_in_order() -> None:
    worker = TorchWorker()
    worker.start()
    try:
        seen: list[int] = []
        names = [
            await worker.call(lambda i=i: seen.append(i) or threading.current_thread().name, 5)
            for i in range(3)
        ]
        assert seen == [0, 1, 2]
        assert set(names) == {"swarmd-torch"}
        assert threading.current_thread().name != "swarmd-torch"
    finally:
        await worker.stop()


async def test_swarm_errors_pass_through_and_others_become_internal() -> None:
    worker = TorchWorker()
    worker.start()
    try:

        def typed() -> None:
            raise ModelLoadError("bad weights")

        def untyped() -> None:
            raise ValueError("shape mismatch")

        with pytest.raises(ModelLoadError, match="bad weights"):
            await worker.call(typed, 5)
        with pytest.raises(InternalError, match="ValueError: shape mismatch"):
            await worker.call(untyped, 5)
        assert await worker.call(lambda: 42, 5) == 42  # still alive
    finally:
        await worker.stop()


async def test_step_timeout_raises_its_own_error() -> None:
    worker = TorchWorker()
    worker.start()
    try:
        with pytest.raises(StepTimeoutError, match=r"0\.01 s"):
            await worker.call(lambda: time.sleep(0.3), 0.01)
        assert await worker.call(lambda: "next", 5) == "next"
    finally:
        await worker.stop()


async def test_stop_ends_the_thread_and_refuses_new_calls() -> None:
    worker = TorchWorker()
    worker.start()
    await worker.stop()
    assert not any(t.name == "swarmd-torch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(InternalError, match="not running"):
        await worker.call(lambda: 1, 5)


async def test_a_queued_job_whose_caller_left_is_skipped_unless_it_must_run() -> None:
    worker = TorchWorker()
    worker.start()
    try:
        ran: list[str] = []
        busy = asyncio.create_task(worker.call(lambda: time.sleep(0.3), 5))
        skipped = asyncio.create_task(worker.call(lambda: ran.append("skipped"), 5))
        must = asyncio.create_task(worker.call(lambda: ran.append("must"), 5, must_run=True))
        await asyncio.sleep(0)  # let both tasks queue their jobs behind the busy one
        skipped.cancel()
        must.cancel()
        await busy
        await worker.call(lambda: None, 5)  # everything queued before has been handled
        assert ran == ["must"]
    finally:
        await worker.stop()


async def test_the_step_timeout_does_not_count_time_in_the_queue() -> None:
    worker = TorchWorker()
    worker.start()
    try:
        busy = asyncio.create_task(worker.call(lambda: time.sleep(0.3), 5))
        await asyncio.sleep(0)  # the busy job is queued first
        assert await worker.call(lambda: "quick", 0.2) == "quick"  # waited 0.3 s queued
        await busy
    finally:
        await worker.stop()
