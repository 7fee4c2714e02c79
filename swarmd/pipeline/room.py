"""`RoomQueue`: distributed requests waiting for a busy stage to have room (asyncio side).

A stage with no session slot or KV room for a request declines it ("cannot take it
now"). When every holder of some layers declines, the request waits here instead of
failing: waiters are woken in arrival order each time one of this node's own distributed
sessions ends (its stages free what it held), and retry at least every `poll_s` for room
that other nodes' sessions free, which this node is not told of. A request waits at most
until its queue deadline (`queue_timeout_s` after it arrived), then gets 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

__all__ = ["RoomQueue"]

POLL_S = 0.5  # retry this often when no session of this node ends meanwhile


class RoomQueue:
    def __init__(self, poll_s: float = POLL_S) -> None:
        self._poll_s = poll_s
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float) -> bool:
        """Wait for a session to end or for the poll interval; False once `deadline`
        (time.monotonic) has passed, without waiting."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(woken)
        try:
            await asyncio.wait_for(woken, min(self._poll_s, remaining))
        except TimeoutError:
            pass
        finally:
            # Timed out or cancelled (wait_for cancels `woken` then): not a waiter now.
            if woken in self._waiters:
                self._waiters.remove(woken)
        return True

    def freed(self) -> None:
        """A session of this node ended: wake the longest waiting request."""
        while self._waiters:
            woken = self._waiters.popleft()
            if not woken.done():  # a timed-out one may wait here for its `finally`
                woken.set_result(None)
                return
