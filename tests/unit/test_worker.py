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

from swarmd.errors import InternalError, ModelLoadError, StepTimeoutError, SwarmError
from swarmd.model import worker as worker_module
from swarmd.model.batching import Gatherer
from swarmd.model.layers import LayerRange
from swarmd.model.runtime import StepRequest
from swarmd.model.sampling import SamplingParams
from swarmd.model.worker import CloseJob, OpenJob, StepJob, TorchWorker
from swarmd.model.worker_trio import run_job


class FakeRuntime:
    """Records the calls; a step's behaviour is chosen by its session id."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.batches: list[list[str]] = []

    def warm_up(self) -> None:
        self.calls.append(("warm_up", "", threading.current_thread().name))

    def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams | None,
        history: list[int] | None = None,
        layers: LayerRange | None = None,
        prompt: list[int] | None = None,
        share: str | None = None,
        resume: tuple[str, int] | None = None,
        keep_as: str | None = None,
        copy: bool = False,
    ) -> int:
        self.calls.append(("open", session_id, threading.current_thread().name))
        return 0

    def step(self, session_id: str, inputs: torch.Tensor, want_token: bool) -> Any:
        self.calls.append(("step", session_id, threading.current_thread().name))
        if session_id == "typed":
            raise ModelLoadError("bad weights")
        if session_id == "untyped":
            raise ValueError("shape mismatch")
        if session_id.startswith("slow") or int(inputs.sum()) == SLOW_STEP:
            time.sleep(0.3)
        return int(inputs.sum())

    def step_many(self, requests: list[StepRequest]) -> list[Any]:
        """Each request's own error stays its own; an untyped one fails the batch."""
        self.batches.append([r.session_id for r in requests])
        outcomes: list[Any] = []
        for r in requests:
            try:
                outcomes.append(self.step(r.session_id, r.inputs, r.want_token))
            except SwarmError as exc:
                outcomes.append(exc)
        return outcomes

    def close(self, session_id: str) -> None:
        self.calls.append(("close", session_id, threading.current_thread().name))


SLOW_STEP = 999  # a step of this value is slow whatever its session


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
    await asyncio.sleep(0.05)  # the busy job is running (a step queued with it would share
    # its forward, and its time)
    assert await worker.run(step("quick", 2), 0.2) == 2  # waited 0.25 s in the queue
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


# --- batches --------------------------------------------------------------------------


async def test_steps_queued_together_run_as_one_batch_in_session_order(
    worker: TorchWorker,
) -> None:
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0.05)  # the busy step is running: the rest queue behind it
    jobs = [step("a", 1), step("b", 2), step("a", 3), CloseJob("b"), step("b", 4), step("c", 5)]
    tasks = [asyncio.create_task(worker.run(job, 5)) for job in jobs]
    await asyncio.sleep(0)
    await busy
    results = await asyncio.gather(*tasks)
    assert results[:3] == [1, 2, 3] and results[4:] == [4, 5]
    batches = worker.runtime.batches  # type: ignore[attr-defined]
    # a's second step and b's step after its close wait for later forwards; c joins.
    assert batches[-3:] == [["a", "b", "c"], ["a"], ["b"]]
    calls = [c[:2] for c in worker.runtime.calls]  # type: ignore[attr-defined]
    assert calls[-4:] == [("step", "c"), ("step", "a"), ("close", "b"), ("step", "b")]


async def test_an_open_goes_before_the_steps_queued_ahead_of_it(worker: TorchWorker) -> None:
    """Under load the forwards queued for open sessions may take a minute; a new
    session's open (milliseconds) does not wait for them, as its ring would time out."""
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0.05)  # the busy step is running: the rest queue behind it
    jobs = [step("slow-a"), step("slow-b"), OpenJob("x", 10, None), OpenJob("y", 10, None)]
    tasks = [asyncio.create_task(worker.run(job, 5)) for job in jobs]
    await asyncio.sleep(0)
    await busy
    await asyncio.gather(*tasks)
    calls = [c[:2] for c in worker.runtime.calls]  # type: ignore[attr-defined]
    assert calls[-4:] == [("open", "x"), ("open", "y"), ("step", "slow-a"), ("step", "slow-b")]


async def test_a_batch_keeps_to_its_token_budget() -> None:
    worker = TorchWorker(FakeRuntime(), batch_tokens=4)
    worker.start()
    try:
        busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
        await asyncio.sleep(0.05)
        chunks = [StepJob(f"s{i}", torch.ones(1, 3, dtype=torch.long), True) for i in range(3)]
        tasks = [asyncio.create_task(worker.run(job, 5)) for job in chunks]
        tasks.append(asyncio.create_task(worker.run(step("d"), 5)))
        await busy
        assert await asyncio.gather(*tasks) == [3, 3, 3, 1]
        batches = worker.runtime.batches[1:]  # type: ignore[attr-defined]
        assert batches == [["s0", "d"], ["s1"], ["s2"]]  # 3 + 1 tokens, then 3 and 3
    finally:
        await worker.stop()


async def test_an_error_of_one_row_leaves_the_others_of_its_batch(worker: TorchWorker) -> None:
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0.05)
    good = asyncio.create_task(worker.run(step("good", 9), 5))
    bad = asyncio.create_task(worker.run(step("typed"), 5))
    await busy
    assert await good == 9
    with pytest.raises(ModelLoadError):
        await bad
    assert worker.runtime.batches[-1] == ["good", "typed"]  # type: ignore[attr-defined]


def test_the_gatherer_waits_only_for_sessions_that_come_back_quickly() -> None:
    now = [100.0]
    gatherer = Gatherer(0.005, clock=lambda: now[0])
    gatherer.ended(["quick", "slow"])
    gatherer.arrived("quick", 100.001)  # back 1 ms after its step ended
    gatherer.arrived("slow", 100.050)  # a ring: 50 ms
    now[0] = 100.060
    gatherer.ended(["quick", "slow"])
    assert gatherer.wait_until({"slow"}) == pytest.approx(100.060 + 1.5 * 0.001 + 0.0005)
    assert gatherer.wait_until({"quick"}) == 100.060  # nobody to wait for
    gatherer.forget("quick")
    assert gatherer.wait_until(set()) == 100.060
    gatherer.ended(["new"])  # no gap known yet: not waited for
    assert gatherer.wait_until(set()) == 100.060


# --- a stage on rings --------------------------------------------------------------------


async def queued_together(worker: TorchWorker, sids: list[str]) -> list[list[str]]:
    """Queue a step of each of `sids` behind a busy forward; the forwards they ran in."""
    busy = asyncio.create_task(worker.run(step("slow-busy"), 5))
    await asyncio.sleep(0.05)  # the busy step is running: the rest queue behind it
    before = len(worker.runtime.batches)  # type: ignore[attr-defined]
    tasks = [asyncio.create_task(worker.run(step(sid), 5)) for sid in sids]
    await busy
    await asyncio.gather(*tasks)
    return worker.runtime.batches[before:]  # type: ignore[attr-defined]


async def test_a_ring_stage_runs_its_sessions_in_groups_of_their_share() -> None:
    """Sessions on a ring of N stages move as N groups, one a stage: 8 sessions of a
    two-stage ring queued together run as two forwards of 4 (oldest first); one that runs
    here alone counts whole, so 4 ring sessions and 2 local ones share forwards of 4."""
    worker = TorchWorker(FakeRuntime())
    worker.start()
    try:
        ring = [f"r{i}" for i in range(8)]
        for sid in ring:
            await worker.run(OpenJob(sid, 10, None, ring=2), 5)
        assert await queued_together(worker, ring) == [ring[:4], ring[4:]]
        for sid in ring[4:]:
            await worker.run(CloseJob(sid), 5)
        for sid in ("l0", "l1"):  # ring 1: this node runs every layer
            await worker.run(OpenJob(sid, 10, None), 5)
        mixed = [*ring[:4], "l0", "l1"]  # shares 4 x 1/2 + 2 = 4
        assert await queued_together(worker, mixed) == [mixed[:4], mixed[4:]]
    finally:
        await worker.stop()


async def test_a_ring_forward_short_of_its_share_waits_for_the_steps_coming_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps that come back from a ring at different times are gathered into one forward
    (within half a forward's time), not run as forwards of one row each; sessions that run
    here alone are never capped or held."""
    monkeypatch.setattr(worker_module, "RING_WAIT_MAX_S", 0.25)  # margins for a busy box
    worker = TorchWorker(FakeRuntime())
    worker.start()
    try:
        for sid in ("a", "b", "c", "d"):  # a share of 2 (4 sessions, 2 stages)
            await worker.run(OpenJob(sid, 10, None, ring=2), 5)
        # a slow forward first: the average forward time is 0.3 s, so a forward may wait
        # half of it (0.15 s, under RING_WAIT_MAX_S)
        await worker.run(OpenJob("slow-x", 10, None, ring=2), 5)
        await worker.run(step("slow-x"), 5)
        await worker.run(CloseJob("slow-x"), 5)
        first = asyncio.create_task(worker.run(step("a"), 5))
        await asyncio.sleep(0.008)  # b's step comes back 8 ms after a's
        second = asyncio.create_task(worker.run(step("b"), 5))
        await asyncio.gather(first, second)
        assert worker.runtime.batches[-1] == ["a", "b"]  # type: ignore[attr-defined]
        for sid in ("a", "b", "c", "d"):
            await worker.run(CloseJob(sid), 5)
        await worker.run(OpenJob("solo", 10, None), 5)
        started = time.monotonic()
        await worker.run(step("solo"), 5)
        assert time.monotonic() - started < 0.1  # no ring session: nothing to wait for
    finally:
        await worker.stop()


# --- a lone session's step on its caller's thread ----------------------------------------


def until_idle(worker: TorchWorker) -> None:
    """Wait until the worker has let go of the job it just ended (its waiter wakes as the
    job ends, a moment before the worker is free)."""
    deadline = time.monotonic() + 5
    while worker._busy.locked() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_lone_sessions_short_step_runs_on_the_trio_thread_that_awaits_it() -> None:
    """The stage service's trio thread runs a decode step itself when nothing could share
    the forward (no wake-up of the worker and back); anything else goes to the worker."""
    runtime = FakeRuntime()
    worker = TorchWorker(runtime)
    worker.start()

    def thread_of(sid: str) -> str:
        return [c[2] for c in runtime.calls if c[:2] == ("step", sid)][-1]

    async def main() -> None:
        here = threading.current_thread().name
        await run_job(worker, OpenJob("a", 10, None, ring=2), 5)
        assert await run_job(worker, step("a", 4), 5) == 4
        assert thread_of("a") == "swarmd-torch"  # no forward measured yet: the worker's
        until_idle(worker)
        assert await run_job(worker, step("a", 5), 5) == 5
        assert thread_of("a") == here
        tokens = worker_module.HERE_MAX_TOKENS + 1
        many = StepJob("a", torch.ones(1, tokens, dtype=torch.long), True)
        assert await run_job(worker, many, 5) == tokens
        assert thread_of("a") == "swarmd-torch"  # a prompt's chunk: the worker's
        assert worker.run_here(step("b")) is None  # not open here
        await run_job(worker, OpenJob("b", 10, None, ring=2), 5)
        assert await run_job(worker, step("a", 6), 5) == 6
        assert thread_of("a") == "swarmd-torch"  # two sessions: they may share forwards
        await run_job(worker, CloseJob("b"), 5)
        until_idle(worker)
        assert await run_job(worker, step("a", 7), 5) == 7
        assert thread_of("a") == here

    try:
        trio.run(main)
    finally:
        asyncio.run(worker.stop())


async def test_a_step_is_not_run_here_while_the_worker_has_work_or_forwards_are_slow(
    worker: TorchWorker,
) -> None:
    await worker.run(OpenJob("x", 10, None), 5)
    for _ in range(3):
        await worker.run(step("x"), 5)
    until_idle(worker)
    assert worker.run_here(step("x", 2)) is not None  # idle, quick forwards: it may
    busy = asyncio.create_task(worker.run(step("x", SLOW_STEP), 5))
    await asyncio.sleep(0.05)  # the worker runs it
    assert worker.run_here(step("x")) is None
    assert await busy == SLOW_STEP
    # that forward took 0.3 s: the average is over 20 ms, and a step run here could hold
    # its caller as long
    assert worker.run_here(step("x")) is None
    for _ in range(40):  # the average comes down: quick steps may run here again
        await worker.run(step("x"), 5)
    until_idle(worker)
    ticket = worker.run_here(step("x", 3))
    assert ticket is not None and ticket.outcome() == 3
    here = threading.current_thread().name
    assert worker.runtime.calls[-1] == ("step", "x", here)  # type: ignore[attr-defined]
