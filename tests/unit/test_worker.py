"""The torch worker: typed jobs on one thread, awaited from asyncio and from trio, typed
errors, a timeout on every wait, a clean stop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
import trio

from swarmd.errors import InternalError, ModelLoadError, StepTimeoutError
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams
from swarmd.model.worker import CloseJob, OpenJob, StepJob, TorchWorker
from swarmd.model.worker_trio import run_job


class FakeRuntime:
    """Records the calls; a step's behaviour is chosen by its session id."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def warm_up(self) -> None:
        self.calls.append(("warm_up", "", threading.current_thread().name))

    def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams | None,
        history: list[int] | None = None,
        layers: LayerRange | None = None,
    ) -> None:
        self.calls.append(("open", session_id, threading.current_thread().name))

    def step(
        self, session_id: str, inputs: torch.Tensor, want_token: bool, alone: bool = False
    ) -> Any:
        self.calls.append(("step", session_id, threading.current_thread().name))
        if session_id == "typed":
            raise ModelLoadError("bad weights")
        if session_id == "untyped":
            raise ValueError("shape mismatch")
        if session_id.startswith("slow"):
            time.sleep(0.3)
        return int(inputs.sum())

    def close(self, session_id: str) -> None:
        self.calls.append(("close", session_id, threading.current_thread().name))


def step(sid: str, value: int = 1) -> StepJob:
    return StepJob(sid, torch.tensor([[value]]), True)


@pytest.fixture
async def worker() -> Any:
    w = TorchWorker(FakeRuntime())
    w.start()
    yield w
    await w.stop()


async def test_jobs_run_on_the_worker_thread_in_order(worker: TorchWorker) -> None:
    await worker.run(OpenJob("a", 10, None), 5)
    assert await worker.run(step("a", 7), 5) == 7
    await worker.run(CloseJob("a"), 5)
    calls = worker.runtime.calls  # type: ignore[attr-defined]
    assert [c[:2] for c in calls] == [("warm_up", ""), ("open", "a"), ("step", "a"), ("close", "a")]
    assert {c[2] for c in calls} == {"swarmd-torch"}


async def test_swarm_errors_pass_through_and_others_become_internal(worker: TorchWorker) -> None:
    with pytest.raises(ModelLoadError, match="bad weights"):
        await worker.run(step("typed"), 5)
    with pytest.raises(InternalError, match="ValueError: shape mismatch"):
        await worker.run(step("untyped"), 5)
    assert await worker.run(step("ok", 42), 5) == 42  # still alive


async def test_step_timeout_raises_its_own_error(worker: TorchWorker) -> None:
    with pytest.raises(StepTimeoutError, match=r"0\.01 s"):
        await worker.run(step("slow"), 0.01)
    assert await worker.run(step("next", 3), 5) == 3


async def test_stop_ends_the_thread_and_refuses_new_jobs() -> None:
    worker = TorchWorker(FakeRuntime())
    worker.start()
    await worker.stop()
    assert not any(t.name == "swarmd-torch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(InternalError, match="not running"):
        await worker.run(step("late"), 5)


async def test_a_queued_job_whose_caller_left_is_skipped_but_a_close_runs(
    worker: TorchWorker,
) -> None:
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0.05)  # the busy step is running
    skipped = asyncio.create_task(worker.run(step("skipped"), 5))
    closing = asyncio.create_task(worker.run(CloseJob("must"), 5))
    await asyncio.sleep(0)  # both queued behind the busy one
    skipped.cancel()
    closing.cancel()
    await busy
    await worker.run(step("after"), 5)  # everything queued before has been handled
    names = [c[1] for c in worker.runtime.calls]  # type: ignore[attr-defined]
    assert "skipped" not in names and "must" in names


async def test_the_step_timeout_does_not_count_time_in_the_queue(worker: TorchWorker) -> None:
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0)  # the busy job is queued first
    assert await worker.run(step("quick", 2), 0.2) == 2  # waited 0.3 s in the queue
    await busy


def test_trio_awaits_jobs_without_asyncio() -> None:
    runtime = FakeRuntime()
    worker = TorchWorker(runtime)
    worker.start()

    async def main() -> list[int]:
        results: list[int] = []

        async def one(i: int) -> None:
            results.append(await run_job(worker, step(f"t{i}", i), 5))

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)
        with pytest.raises(StepTimeoutError):
            await run_job(worker, step("slow-trio"), 0.01)
        with pytest.raises(ModelLoadError):
            await run_job(worker, step("typed"), 5)
        await run_job(worker, CloseJob("t0"), 5)
        return results

    try:
        assert sorted(trio.run(main)) == [0, 1, 2, 3, 4]
        assert ("close", "t0", "swarmd-torch") in runtime.calls
    finally:
        asyncio.run(worker.stop())
