"""`RoomQueue`: distributed requests waiting for busy stages to have room (asyncio side).

A stage with no session slot or KV room for a request declines it as "busy". When every
holder of some layers is busy, the request waits here instead of failing, in a line
per thing it waits for (a model's layer ranges, say [15:30) of M), in arrival order: it
joins once and keeps its place however often it is declined again. Each time one of
this node's own distributed sessions ends (its stages free what it held), the first
waiting request of every line is woken to try again; the first of each line also tries
every `poll_s`, for room that other nodes' sessions free, which this node is not told
of (only the first, so a long line does not knock on the stages all at once). One
line's busy stages never hold up another line. A request waits at most until its
deadline, then gets 503 (`RouteBusyError`); one whose client left goes at once.

    ticket = room.join(key)
    while declined:
        if not await room.wait(ticket, deadline): raise ...
    room.leave(ticket)          # admitted, failed or gone: idempotent
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable

from swarmd.errors import ClientDisconnectedError
from swarmd.pipeline.admission import unless_gone

__all__ = ["RoomQueue", "Ticket"]

POLL_S = 0.5  # how often the first of a line tries when no session of this node ends


def _never() -> bool:
    return False


class Ticket:
    """One request's place in its line."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.woken: asyncio.Future[None] | None = None  # set while it waits


class RoomQueue:
    def __init__(self, poll_s: float = POLL_S) -> None:
        self._poll_s = poll_s
        self._lines: dict[Hashable, deque[Ticket]] = {}

    @property
    def waiting(self) -> int:
        """Requests in line (waiting, or trying again after a wake)."""
        return sum(len(line) for line in self._lines.values())

    def line_of(self, model_id: str) -> tuple[str, tuple[tuple[int, int], ...]] | None:
        """The key of the oldest line of requests waiting for `model_id`'s busy stages."""
        for key, line in self._lines.items():
            if line and isinstance(key, tuple) and key[0] == model_id:
                return key
        return None

    def join(self, key: Hashable) -> Ticket:
        ticket = Ticket(key)
        self._lines.setdefault(key, deque()).append(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        line = self._lines.get(ticket.key)
        if line is None or ticket not in line:
            return
        first = line[0] is ticket
        line.remove(ticket)
        if not line:
            del self._lines[ticket.key]
        elif first:
            # The next in line now polls: it tries at once (the room that let this one
            # in may hold another), then every poll_s.
            _wake(line[0])

    async def wait(
        self, ticket: Ticket, deadline: float, gone: Callable[[], bool] = _never
    ) -> bool:
        """Until a session ends (or, first in line, the poll interval): True, try again;
        False when `deadline` (time.monotonic) passes first (or has passed: no wait).
        `gone` is asked while it waits (`unless_gone`): when it says the client
        left, the request leaves its line (ClientDisconnectedError) instead of keeping its
        place to the end."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        line = self._lines.setdefault(ticket.key, deque())
        if ticket not in line:
            line.append(ticket)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.woken = woken
        timeout = min(self._poll_s, remaining) if line[0] is ticket else remaining
        try:
            # `asyncio.wait` leaves `woken` alone when it times out or is cancelled.
            await unless_gone(asyncio.wait({woken}, timeout=timeout), gone)
        except ClientDisconnectedError:
            self.leave(ticket)
            raise
        except asyncio.CancelledError:
            if woken.done() and not woken.cancelled():
                self._wake_first(line, but=ticket)  # its wake is not lost with it
            raise
        finally:
            ticket.woken = None
        # Woken, or a poll: try. Out of time unwoken: the deadline has come, no last try.
        return woken.done() or time.monotonic() < deadline

    def freed(self) -> None:
        """A session of this node ended: wake the first waiting request of every line."""
        for line in list(self._lines.values()):
            self._wake_first(line)

    @staticmethod
    def _wake_first(line: deque[Ticket], but: Ticket | None = None) -> None:
        for ticket in line:
            if ticket is not but and _wake(ticket):
                return


def _wake(ticket: Ticket) -> bool:
    woken = ticket.woken
    if woken is None or woken.done():
        return False
    woken.set_result(None)
    return True
