"""`RoomQueue`: requests waiting for a busy stage keep their place in line; a session's
end wakes the first, and only the first polls."""

from __future__ import annotations

import asyncio
import time

from swarmd.pipeline.room import RoomQueue, Ticket

FAR = 60.0


def test_each_ended_session_wakes_the_first_waiting_request_in_arrival_order() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        woken: list[int] = []

        async def request(n: int, ticket: Ticket) -> None:
            assert await room.wait(ticket, time.monotonic() + FAR)
            woken.append(n)
            room.leave(ticket)  # admitted

        tickets = [room.join() for _ in range(3)]
        tasks = [asyncio.ensure_future(request(n, t)) for n, t in enumerate(tickets)]
        await asyncio.sleep(0.01)
        assert room.waiting == 3
        room.freed()
        await asyncio.sleep(0.01)
        # The first was let in; leaving, it woke the next to try at once (the room that
        # took it may hold another), which leaves too, and so on down the line.
        assert woken == [0, 1, 2]
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert room.waiting == 0

    asyncio.run(run())


def test_a_request_declined_again_keeps_its_place_and_only_the_first_polls() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=0.05)
        first, second = room.join(), room.join()
        started = time.monotonic()
        assert await room.wait(first, started + FAR)  # nothing ended: back after a poll
        assert 0.04 <= time.monotonic() - started < 5.0
        second_waits = asyncio.ensure_future(room.wait(second, time.monotonic() + FAR))
        await asyncio.sleep(0.2)
        assert not second_waits.done()  # not first in line: it does not poll
        assert await room.wait(first, time.monotonic() + FAR)  # declined again: still first
        room.freed()  # wakes the first one that waits: `second`, as `first` is trying
        assert await asyncio.wait_for(second_waits, 5.0)
        assert room.waiting == 2
        room.leave(first)
        room.leave(first)  # idempotent
        room.leave(second)
        assert room.waiting == 0

    asyncio.run(run())


def test_no_wait_past_the_deadline_and_a_request_that_left_wakes_nobody() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        ticket = room.join()
        assert not await room.wait(ticket, time.monotonic() - 0.001)
        gone, stays = room.join(), room.join()
        gone_waits = asyncio.ensure_future(room.wait(gone, time.monotonic() + FAR))
        stays_waits = asyncio.ensure_future(room.wait(stays, time.monotonic() + FAR))
        await asyncio.sleep(0.01)
        gone_waits.cancel()  # its client left while it waited
        room.leave(gone)
        room.leave(ticket)  # the first leaves: `stays` is first now, and tries at once
        assert await asyncio.wait_for(stays_waits, 5.0)
        room.leave(stays)
        room.freed()  # nobody in line: nothing happens, nothing is kept for later
        assert room.waiting == 0

    asyncio.run(run())
