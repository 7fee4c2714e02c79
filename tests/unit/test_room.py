"""`RoomQueue`: requests waiting for a busy stage keep their place in line; a session's
end wakes the first, and only the first polls."""

from __future__ import annotations

import asyncio
import time

from swarmd.errors import ClientDisconnectedError
from swarmd.pipeline.room import RoomQueue, Ticket

FAR = 60.0
KEY = ("m", ((10, 20),))


def test_each_ended_session_wakes_the_first_waiting_request_in_arrival_order() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        woken: list[int] = []

        async def request(n: int, ticket: Ticket) -> None:
            assert await room.wait(ticket, time.monotonic() + FAR)
            woken.append(n)
            room.leave(ticket)  # admitted

        tickets = [room.join(KEY) for _ in range(3)]
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
        first, second = room.join(KEY), room.join(KEY)
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
        ticket = room.join(KEY)
        assert not await room.wait(ticket, time.monotonic() - 0.001)
        gone, stays = room.join(KEY), room.join(KEY)
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


def test_one_lines_busy_stages_never_hold_up_another_line() -> None:
    """A request waiting for a stage that stays full (first of its line, polling) does not
    keep a request for other layers from its wakes, nor from polling itself."""

    async def run() -> None:
        room = RoomQueue(poll_s=0.05)
        stuck = room.join(KEY)
        other = room.join(("m", ((20, 30),)))
        stuck_waits = asyncio.ensure_future(room.wait(stuck, time.monotonic() + FAR))
        other_waits = asyncio.ensure_future(room.wait(other, time.monotonic() + FAR))
        await asyncio.sleep(0.01)
        room.freed()  # wakes the first waiting request of every line
        assert await asyncio.wait_for(stuck_waits, 5.0)
        assert await asyncio.wait_for(other_waits, 5.0)
        started = time.monotonic()
        assert await room.wait(other, started + FAR)  # first of its own line: it polls
        assert time.monotonic() - started < 5.0
        assert room.waiting == 2
        room.leave(stuck)
        room.leave(other)
        assert room.waiting == 0

    asyncio.run(run())


def test_a_wake_that_reaches_a_request_as_it_is_cancelled_is_not_lost() -> None:
    """Woken, then cancelled before it runs: either it still takes the wake (asyncio's
    wait_for on 3.11 returns the result and drops the cancellation), or the wake goes on
    to the next waiting request; never neither."""

    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        first, gone, stays = room.join(KEY), room.join(KEY), room.join(KEY)
        gone_waits = asyncio.ensure_future(room.wait(gone, time.monotonic() + FAR))
        stays_waits = asyncio.ensure_future(room.wait(stays, time.monotonic() + FAR))
        await asyncio.sleep(0.01)
        room.freed()  # `first` is trying, not waiting: `gone` gets the wake ...
        gone_waits.cancel()  # ... and its client leaves before it runs
        await asyncio.wait({gone_waits}, timeout=5.0)
        took_it = not gone_waits.cancelled() and gone_waits.result() is True
        room.leave(gone)
        if not took_it:
            assert await asyncio.wait_for(stays_waits, 5.0)  # the wake was passed on
        else:
            await asyncio.sleep(0.05)
            assert not stays_waits.done()  # one wake, one try
            stays_waits.cancel()
        room.leave(first)
        room.leave(stays)
        assert room.waiting == 0

    asyncio.run(run())


def test_a_request_whose_client_left_leaves_its_line_and_the_next_moves_up() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        first, second = room.join(KEY), room.join(KEY)
        gone = False
        first_waits = asyncio.ensure_future(room.wait(first, time.monotonic() + FAR, lambda: gone))
        second_waits = asyncio.ensure_future(room.wait(second, time.monotonic() + FAR))
        await asyncio.sleep(0.05)
        assert not first_waits.done() and room.waiting == 2
        gone = True
        started = time.monotonic()
        try:
            await asyncio.wait_for(first_waits, 5.0)
        except ClientDisconnectedError:
            pass
        else:
            raise AssertionError("a request whose client left kept waiting")
        assert time.monotonic() - started < 2.0  # not at its deadline, a minute away
        # Its place went, and the next in line tried at once (it is first now).
        assert await asyncio.wait_for(second_waits, 5.0)
        assert room.waiting == 1
        room.leave(second)

    asyncio.run(run())


def test_a_wait_that_reaches_its_deadline_unwoken_says_so_without_a_last_try() -> None:
    async def run() -> None:
        room = RoomQueue(poll_s=30.0)
        first, second = room.join(KEY), room.join(KEY)
        started = time.monotonic()
        assert not await room.wait(second, started + 0.2)  # not first: it never polled
        assert 0.15 <= time.monotonic() - started < 5.0
        assert not await room.wait(first, time.monotonic() + 0.1)  # first, poll past it
        room.leave(first)
        room.leave(second)

    asyncio.run(run())
