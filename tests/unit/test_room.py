"""`RoomQueue`: requests waiting for a busy stage are woken in arrival order."""

from __future__ import annotations

import asyncio
import time

from swarmd.pipeline.room import RoomQueue


def test_waiters_are_woken_one_per_ended_session_in_arrival_order() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        woken: list[int] = []

        async def waiter(n: int) -> None:
            assert await room.wait(time.monotonic() + 60.0)
            woken.append(n)

        tasks = []
        for n in range(3):
            tasks.append(asyncio.ensure_future(waiter(n)))
            await asyncio.sleep(0)  # queued in this order
        await asyncio.sleep(0.01)
        assert room.waiting == 3
        room.freed()
        await asyncio.sleep(0.01)
        assert woken == [0]
        room.freed()
        room.freed()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert woken == [0, 1, 2] and room.waiting == 0

    asyncio.run(run())


def test_a_wait_ends_at_the_poll_interval_and_not_at_all_past_the_deadline() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=0.05)
        started = time.monotonic()
        assert await room.wait(started + 60.0)  # nothing ended: back after one poll
        assert 0.04 <= time.monotonic() - started < 5.0
        assert room.waiting == 0
        assert not await room.wait(time.monotonic() - 0.001)
        room.freed()  # no waiter: nothing happens, nothing is kept for later
        assert room.waiting == 0

    asyncio.run(run())


def test_a_waiter_that_left_does_not_swallow_the_wake_of_the_next() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        gone = asyncio.ensure_future(room.wait(time.monotonic() + 60.0))
        await asyncio.sleep(0.01)
        stays = asyncio.ensure_future(room.wait(time.monotonic() + 60.0))
        await asyncio.sleep(0.01)
        gone.cancel()  # its client left
        await asyncio.sleep(0.01)
        assert room.waiting == 1
        room.freed()
        assert await asyncio.wait_for(stays, 5.0)

    asyncio.run(run())
