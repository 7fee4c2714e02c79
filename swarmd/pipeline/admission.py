"""`KVBudget`: a stage's KV cache room in tokens, reserved per session from admission to end.

A session reserves its prompt plus `max_tokens` before it runs and gives them back when it
ends, however it ends, so a stage never holds more cache than its budget. Requests this
node coordinates wait for room in FIFO order (`reserve`, with the queue timeout); a
session another node's route opens here either fits now or is refused at once
(`try_reserve`: a stage never keeps a remote coordinator waiting, which would look like
a silent stage). A request larger than the whole budget is refused at once with 413.

The API (asyncio) and the stage service (trio, a guest run on the same loop and thread)
both use it, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from swarmd.errors import KVRoomError, OverloadedError


def needs_more_than(need: int, holds: int) -> KVRoomError:
    return KVRoomError(
        f"This conversation needs {need:,} tokens (prompt plus max_tokens); "
        f"the route holds {holds:,}"
    )


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future[None]


class KVBudget:
    def __init__(self, total_tokens: int) -> None:
        if total_tokens < 1:
            raise ValueError("a KV budget holds at least one token")
        self.total = total_tokens
        self.reserved = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def free(self) -> int:
        return self.total - self.reserved

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_reserve(self, tokens: int) -> bool:
        """Reserve now if it fits and nobody waits ahead; never waits."""
        if tokens > self.free or self._waiters:
            return False
        self.reserved += tokens
        return True

    async def reserve(self, tokens: int, timeout_s: float) -> None:
        """Wait (FIFO) until `tokens` fit. ContextLengthError when they never can,
        OverloadedError when the wait passes `timeout_s`."""
        if tokens > self.total:
            raise needs_more_than(tokens, self.total)
        if self.try_reserve(tokens):
            return
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        granted = False
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
            granted = True
        except TimeoutError:
            raise OverloadedError(
                f"The KV budget ({self.total:,} tokens) stayed too full for this request's "
                f"{tokens:,} for {timeout_s:g} s"
            ) from None
        finally:
            if not granted:  # timed out or cancelled
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self._grant()  # the ones behind it may fit now
                else:  # granted just as it gave up: the tokens go back
                    self.release(tokens)

    def release(self, tokens: int) -> None:
        self.reserved = max(0, self.reserved - tokens)
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0].tokens <= self.free:
            waiter = self._waiters.popleft()
            self.reserved += waiter.tokens
            waiter.future.set_result(None)
