"""QuickLock / QuickSemaphore: trio's lock and semaphore, minus the scheduler pass of a
free acquire (swarmd/net/quick_locks.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.io.trio import TrioTCPStream

from swarmd.net import host as _host  # noqa: F401 - importing the host applies the patches
from swarmd.net.quick_locks import QuickLock, QuickSemaphore
from tests.trio_run import run_trio

DEADLINE_S = 10.0


class _Steps(trio.abc.Instrument):
    """Counts how often one task is resumed by the scheduler."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


@pytest.mark.parametrize("make", [QuickLock, lambda: QuickSemaphore(1), trio.Lock])
def test_a_free_lock_is_taken_without_a_scheduler_pass(make) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        lock = make()
        steps = _Steps(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(steps)
        try:
            for _ in range(10):
                async with lock:
                    pass
        finally:
            trio.lowlevel.remove_instrument(steps)
        # trio's own lock yields to the scheduler on every acquire; a quick one never
        # when it is free.
        assert steps.steps == (10 if make is trio.Lock else 0)

    run_trio(body, DEADLINE_S)


def test_a_held_lock_makes_the_others_wait_in_turn() -> None:
    async def body() -> None:
        lock = QuickLock()
        order: list[str] = []

        async def take(name: str) -> None:
            async with lock:
                order.append(name)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            await lock.acquire()
            for name in ("a", "b", "c"):
                nursery.start_soon(take, name)
                await trio.testing.wait_all_tasks_blocked()
            assert lock.locked() and order == []
            assert lock.statistics().tasks_waiting == 3
            lock.release()
        assert order == ["a", "b", "c"] and not lock.locked()

    run_trio(body, DEADLINE_S)


@pytest.mark.parametrize("make", [QuickLock, lambda: QuickSemaphore(1)])
def test_a_cancelled_task_is_stopped_at_a_free_lock(make) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        lock = make()
        reached = False
        with trio.CancelScope() as scope:
            scope.cancel()
            async with lock:
                reached = True
        assert scope.cancelled_caught and not reached
        async with lock:  # not left held
            pass

    run_trio(body, DEADLINE_S)


def test_only_the_owner_releases_a_quick_lock() -> None:
    async def body() -> None:
        lock = QuickLock()
        await lock.acquire()
        failure: list[BaseException] = []

        async def release_it() -> None:
            try:
                lock.release()
            except RuntimeError as exc:
                failure.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_it)
        assert len(failure) == 1 and lock.locked()
        lock.release()

    run_trio(body, DEADLINE_S)


def test_py_libp2p_streams_get_quick_locks() -> None:
    stream = TrioTCPStream(None)  # type: ignore[arg-type]
    assert isinstance(stream.read_lock, QuickLock) and isinstance(stream.write_lock, QuickLock)
