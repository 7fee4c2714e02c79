"""TrioBridge: trio in a thread of its own beside the asyncio loop, calls both ways,
cancellation, stop."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import trio

from swarmd.errors import InternalError
from swarmd.net.bridge import TrioBridge


@pytest.fixture
async def bridge() -> AsyncIterator[TrioBridge]:
    bridge = TrioBridge()
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `predicate()` on the asyncio loop until true; fail past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s")
        await asyncio.sleep(0.001)


@dataclass
class Record:
    """What a trio function saw, written from trio and read from asyncio."""

    started: bool = False
    events: list[str] = field(default_factory=list)


async def sleep_until_cancelled(record: Record) -> None:
    """Sleep forever; when cancelled, take a few trio ticks to unwind, noting each step."""
    record.started = True
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        record.events.append("cancelled")
        raise
    finally:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.05)  # cleanup that takes time (and trio checkpoints)
        record.events.append("unwound")


class Boom(Exception):
    pass


# --- asyncio -> trio -----------------------------------------------------------------


async def test_run_returns_a_value_computed_in_trio(bridge: TrioBridge) -> None:
    async def add(a: int, b: int) -> tuple[int, bool]:
        await trio.lowlevel.checkpoint()
        return a + b, trio.lowlevel.current_task() is not None

    assert bridge.running
    assert await bridge.run(add, 2, 3) == (5, True)


async def test_run_raises_the_trio_exception_itself(bridge: TrioBridge) -> None:
    raised: list[Boom] = []

    async def fail() -> None:
        await trio.lowlevel.checkpoint()
        raised.append(Boom("from trio"))
        raise raised[0]

    with pytest.raises(Boom, match="from trio") as info:
        await bridge.run(fail)
    assert info.value is raised[0]
    assert bridge.running  # one failed call does not take the bridge down
    assert await bridge.run(trio.sleep, 0) is None


async def test_run_raises_errors_of_a_trio_nursery_as_a_group(bridge: TrioBridge) -> None:
    async def fail_in_child() -> None:
        async def child() -> None:
            await trio.lowlevel.checkpoint()
            raise Boom("child")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)

    with pytest.raises(ExceptionGroup) as info:
        await bridge.run(fail_in_child)
    assert info.group_contains(Boom, match="child")
    assert bridge.running


async def test_many_calls_run_concurrently(bridge: TrioBridge) -> None:
    async def slow_echo(value: int) -> int:
        await trio.sleep(0.05)
        return value

    started = time.monotonic()
    results = await asyncio.gather(*(bridge.run(slow_echo, i) for i in range(50)))
    assert results == list(range(50))
    assert time.monotonic() - started < 2.0  # not 50 x 50 ms one after another


async def test_cancelling_the_caller_cancels_the_trio_call(bridge: TrioBridge) -> None:
    record = Record()
    task = asyncio.create_task(bridge.run(sleep_until_cancelled, record))
    await eventually(lambda: record.started)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Both steps happened before the asyncio side saw CancelledError.
    assert record.events == ["cancelled", "unwound"]
    assert bridge.running


async def test_a_second_cancel_while_unwinding_still_waits_for_trio(bridge: TrioBridge) -> None:
    record = Record()
    task = asyncio.create_task(bridge.run(sleep_until_cancelled, record))
    await eventually(lambda: record.started)

    task.cancel()
    await eventually(lambda: record.events == ["cancelled"])
    task.cancel()  # trio is mid-cleanup; the caller must keep waiting for it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert record.events == ["cancelled", "unwound"]


async def test_wait_for_timeout_cancels_the_trio_call(bridge: TrioBridge) -> None:
    record = Record()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(bridge.run(sleep_until_cancelled, record), 0.05)
    assert record.events == ["cancelled", "unwound"]


async def test_wait_for_returns_when_the_call_is_in_time(bridge: TrioBridge) -> None:
    async def quick() -> str:
        await trio.sleep(0.001)
        return "done"

    assert await asyncio.wait_for(bridge.run(quick), 5.0) == "done"


async def test_asyncio_stays_responsive_while_trio_sleeps(bridge: TrioBridge) -> None:
    record = Record()

    async def nap() -> None:
        record.started = True
        await trio.sleep(1.0)
        record.events.append("woke")

    call = asyncio.create_task(bridge.run(nap))
    await eventually(lambda: record.started)
    started = time.monotonic()
    await asyncio.sleep(0.01)
    assert time.monotonic() - started < 0.2
    assert not call.done()
    await call
    assert record.events == ["woke"]


# --- background tasks --------------------------------------------------------------


async def test_start_soon_runs_a_background_task_that_stop_cancels() -> None:
    bridge = TrioBridge()
    await bridge.start()
    record = Record()
    bridge.start_soon(sleep_until_cancelled, record)
    await eventually(lambda: record.started)

    await bridge.stop()
    assert record.events == ["cancelled", "unwound"]
    assert not bridge.running


async def test_a_failing_background_task_ends_the_run_and_stop_reports_it() -> None:
    bridge = TrioBridge()
    await bridge.start()

    async def crash() -> None:
        await trio.lowlevel.checkpoint()
        raise Boom("background")

    bridge.start_soon(crash)
    await eventually(lambda: not bridge.running)
    with pytest.raises(InternalError) as info:
        await bridge.run(trio.sleep, 0)
    assert "not running" in str(info.value)

    with pytest.raises(InternalError, match="trio run failed") as info:
        await bridge.stop()
    assert isinstance(info.value.__cause__, ExceptionGroup)
    assert info.value.__cause__.subgroup(Boom) is not None
    await bridge.stop()  # reported once; stopping again is quiet


async def test_stop_while_a_call_runs_raises_internal_error_to_its_caller() -> None:
    bridge = TrioBridge()
    await bridge.start()
    record = Record()
    call = asyncio.create_task(bridge.run(sleep_until_cancelled, record))
    await eventually(lambda: record.started)

    await bridge.stop()
    assert record.events == ["cancelled", "unwound"]
    with pytest.raises(InternalError, match="stopped while the call ran"):
        await call


# --- trio -> asyncio ---------------------------------------------------------------


async def test_to_asyncio_awaits_an_asyncio_coroutine_from_trio(bridge: TrioBridge) -> None:
    async def on_asyncio(value: int) -> tuple[int, bool]:
        await asyncio.sleep(0.01)
        return value * 2, asyncio.current_task() is not None

    async def on_trio() -> tuple[int, bool]:
        await trio.lowlevel.checkpoint()
        return await bridge.to_asyncio(on_asyncio(21))

    assert await bridge.run(on_trio) == (42, True)


async def test_to_asyncio_raises_the_asyncio_exception_in_trio(bridge: TrioBridge) -> None:
    async def on_asyncio() -> None:
        await asyncio.sleep(0)
        raise Boom("from asyncio")

    async def on_trio() -> str:
        try:
            await bridge.to_asyncio(on_asyncio())
        except Boom as exc:
            return f"trio caught {exc}"
        return "nothing raised"

    assert await bridge.run(on_trio) == "trio caught from asyncio"


async def test_cancelling_trio_cancels_the_asyncio_task_and_waits_for_it(
    bridge: TrioBridge,
) -> None:
    events: list[str] = []

    async def on_asyncio(token: trio.lowlevel.TrioToken, started: trio.Event) -> None:
        token.run_sync_soon(started.set)  # asyncio code reaches trio only via the token
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append("asyncio cancelled")
            raise
        finally:
            await asyncio.sleep(0.02)  # cleanup that takes loop iterations
            events.append("asyncio unwound")

    async def cancel_once_started(started: trio.Event, scope: trio.CancelScope) -> None:
        with trio.fail_after(5):
            await started.wait()
        scope.cancel()

    async def on_trio() -> None:
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_started, started, nursery.cancel_scope)
            await bridge.to_asyncio(on_asyncio(trio.lowlevel.current_trio_token(), started))
        events.append("trio resumed")

    await bridge.run(on_trio)
    assert events == ["asyncio cancelled", "asyncio unwound", "trio resumed"]


async def test_asyncio_and_trio_calls_nest(bridge: TrioBridge) -> None:
    async def trio_leaf() -> str:
        await trio.lowlevel.checkpoint()
        return "leaf"

    async def asyncio_middle() -> str:
        return "middle>" + await bridge.run(trio_leaf)

    async def trio_top() -> str:
        return "top>" + await bridge.to_asyncio(asyncio_middle())

    assert await bridge.run(trio_top) == "top>middle>leaf"


# --- lifecycle ---------------------------------------------------------------------


async def test_calls_outside_the_running_window_raise_internal_error() -> None:
    bridge = TrioBridge()
    assert not bridge.running
    with pytest.raises(InternalError):
        await bridge.run(trio.sleep, 0)
    with pytest.raises(InternalError):
        bridge.start_soon(trio.sleep, 0)
    await bridge.stop()  # stopping a bridge that never started is a no-op

    await bridge.start()
    with pytest.raises(InternalError, match="twice"):
        await bridge.start()
    await bridge.stop()
    with pytest.raises(InternalError):
        await bridge.run(trio.sleep, 0)
    with pytest.raises(InternalError):
        bridge.start_soon(trio.sleep, 0)


def trio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "swarmd-trio"]


async def test_stop_is_idempotent_and_ends_the_trio_run() -> None:
    async with TrioBridge() as bridge:
        assert await bridge.run(trio.sleep, 0) is None
        assert len(trio_threads()) == 1
    assert not bridge.running
    assert trio_threads() == []  # stop() returns once the trio thread has ended
    await bridge.stop()
    await asyncio.gather(bridge.stop(), bridge.stop())
    async with TrioBridge() as again:
        assert await again.run(trio.sleep, 0) is None


async def test_trio_runs_in_its_own_thread_and_asyncio_in_the_loops(bridge: TrioBridge) -> None:
    loop_thread = threading.current_thread()

    async def where_trio_runs() -> threading.Thread:
        await trio.lowlevel.checkpoint()
        return threading.current_thread()

    async def where_asyncio_runs() -> threading.Thread:
        await asyncio.sleep(0)
        return threading.current_thread()

    async def from_trio() -> threading.Thread:
        return await bridge.to_asyncio(where_asyncio_runs())

    trio_thread = await bridge.run(where_trio_runs)
    assert trio_thread is not loop_thread and trio_thread.name == "swarmd-trio"
    assert await bridge.run(from_trio) is loop_thread
    with pytest.raises(RuntimeError):  # no trio run in the loop's thread
        trio.lowlevel.current_trio_token()


async def test_two_bridges_run_side_by_side(bridge: TrioBridge) -> None:
    async with TrioBridge() as second:
        token_one = await bridge.run(_token)
        token_two = await second.run(_token)
        assert token_one is not token_two
        assert len(trio_threads()) == 2
    assert bridge.running


async def _token() -> trio.lowlevel.TrioToken:
    await trio.lowlevel.checkpoint()
    return trio.lowlevel.current_trio_token()


async def test_to_asyncio_from_another_trio_run_is_refused(bridge: TrioBridge) -> None:
    async with TrioBridge() as other:

        async def asyncio_side() -> int:
            return 1

        async def call_the_wrong_bridge() -> None:
            await bridge.to_asyncio(asyncio_side())

        with pytest.raises(InternalError, match="another trio run"):
            await other.run(call_the_wrong_bridge)


async def test_stop_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    bridge = TrioBridge()
    await bridge.start()
    record = Record()
    bridge.start_soon(sleep_until_cancelled, record)
    await bridge.run(trio.to_thread.run_sync, time.sleep, 0.01)  # trio's own thread cache
    await bridge.stop()
    assert record.events == ["cancelled", "unwound"]

    # Left after stop: at most trio's cached worker threads, idle, and gone after trio's
    # 10 s idle timeout.
    added = set(threading.enumerate()) - before
    assert all(t.daemon and t.name.startswith("Trio thread") for t in added), added
    await eventually(lambda: not set(threading.enumerate()) - before, timeout_s=15.0)


async def test_sigint_stays_with_asyncio() -> None:
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        async with TrioBridge() as bridge:
            assert await bridge.run(trio.sleep, 0) is None
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
