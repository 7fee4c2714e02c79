"""`RoomQueue`: distributed requests waiting for a busy stage to have room (asyncio side).

A stage with no session slot or KV room for a request declines it ("cannot take it
now"). When every holder of some layers declines, the request waits here instead of
failing, in arrival order: it joins once and keeps its place however often it is
declined again. Each time one of this node's own distributed sessions ends (its stages
free what it held), the first waiting request is woken to try again; the first in line
also tries every `poll_s`, for room that other nodes' sessions free, which this node is
not told of (only the first, so a long queue does not knock on the stages all at once).
A request waits at most until its queue deadline, then gets 503 (`RouteBusyError`).

    ticket = room.join()
    while declined:
        if not await room.wait(ticket, deadline): raise ...
    room.leave(ticket)          # admitted, failed or gone: idempotent
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

__all__ = ["RoomQueue", "Ticket"]

POLL_S = 0.5  # how often the first in line tries when no session of this node ends


class Ticket:
    """One request's place in the queue."""

    def __init__(self) -> None:
        self.woken: asyncio.Future[None] | None = None  # set while it waits


class RoomQueue:
    def __init__(self, poll_s: float = POLL_S) -> None:
        self._poll_s = poll_s
        self._line: deque[Ticket] = deque()

    @property
    def waiting(self) -> int:
        """Requests in line (waiting, or trying again after a wake)."""
        return len(self._line)

    def join(self) -> Ticket:
        ticket = Ticket()
        self._line.append(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if ticket not in self._line:
            return
        first = self._line[0] is ticket
        self._line.remove(ticket)
        if first and self._line:
            # The next in line now polls: it tries at once (the room that let this one
            # in may hold another), then every poll_s.
            _wake(self._line[0])

    async def wait(self, ticket: Ticket, deadline: float) -> bool:
        """Until a session ends (or, first in line, the poll interval); False once
        `deadline` (time.monotonic) has passed, without waiting."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if ticket not in self._line:
            self._line.append(ticket)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.woken = woken
        timeout = min(self._poll_s, remaining) if self._line[0] is ticket else remaining
        try:
            await asyncio.wait_for(woken, timeout)
        except TimeoutError:
            pass
        finally:
            ticket.woken = None
        return True

    def freed(self) -> None:
        """A session of this node ended: wake the first request in line that waits."""
        for ticket in self._line:
            if _wake(ticket):
                return


def _wake(ticket: Ticket) -> bool:
    woken = ticket.woken
    if woken is None or woken.done():
        return False
    woken.set_result(None)
    return True
