"""`KVBudget`: a stage's KV cache room in tokens, reserved per session from admission to end;
`PeerBudget`: the part of it remote coordinators may hold, per peer and in all.

A session reserves its prompt plus `max_tokens` before it runs and gives them back when it
ends, however it ends, so a stage never holds more cache than its budget. Requests this
node coordinates wait for room in FIFO order (`reserve`, with the queue timeout); a
session another node's route opens here either fits now or is refused at once
(`try_reserve`: a stage never keeps a remote coordinator waiting, which would look like
a silent stage). A request larger than the whole budget is refused at once with 413.

The API (asyncio, the main thread) and the stage service (trio, its own thread) both use
them: each holds a lock of its own, and a waiter's future is resolved on its loop.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from swarmd.errors import ClientDisconnectedError, KVRoomError, OverloadedError
from swarmd.net.bridge import resolve_soon

T = TypeVar("T")

GONE_CHECK_S = 0.5  # how often a waiting request looks whether its client is still there


async def unless_gone(waiting: Awaitable[T], client_gone: Callable[[], bool]) -> T:
    """`waiting`'s result, unless `client_gone` says (asked every `GONE_CHECK_S`) that the
    client left first: then `waiting` is cancelled and ClientDisconnectedError raised. A
    request whose client left would otherwise keep its place in a queue for minutes, and
    run (if only to its first step) when let in.

    Whatever `waiting` takes it must record itself, before it returns: when this is
    cancelled just as `waiting` succeeds, the result is dropped here, and only the
    record tells the caller what to give back. This returns only once `waiting` has
    ended, so nothing it takes lands after the caller has cleaned up."""
    task = asyncio.ensure_future(waiting)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=GONE_CHECK_S)
            if done:
                return task.result()
            if client_gone():
                raise ClientDisconnectedError("The client closed the connection while waiting")
    finally:
        if not task.done():
            task.cancel()
            cancelled = False
            while not task.done():  # a second cancel must not leave it running unwatched
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError


def needs_more_than(need: int, holds: int) -> KVRoomError:
    return KVRoomError(
        f"This conversation needs {need:,} tokens (prompt plus max_tokens); "
        f"the route holds {holds:,}"
    )


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future[None]


class SessionSlots:
    """A coordinator's session slots (`max_sessions`), taken in FIFO order; `in_flight`
    counts the requests holding one."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s  # how long a request waits for one (its queue timeout)
        self.in_flight = 0
        self._free = asyncio.Semaphore(size)

    @property
    def free(self) -> int:
        return self.size - self.in_flight

    def slot(self, client_gone: Callable[[], bool]) -> SessionSlot:
        """One request's slot, not taken yet."""
        return SessionSlot(self, client_gone)


class SessionSlot:
    """One request's slot of its coordinator's `SessionSlots`. A distributed request
    gives it back while it waits for a busy stage and takes it again (in turn) before it
    tries, so requests that wait for one model's full stages never keep the node's
    slots from requests for other models (or other routes)."""

    def __init__(self, slots: SessionSlots, client_gone: Callable[[], bool]) -> None:
        self._slots = slots
        self._client_gone = client_gone
        self.held = False

    def would_wait(self) -> bool:
        """Whether `take` would wait now: no free slot, or others waiting ahead."""
        return self._slots._free.locked()

    async def take(self, deadline: float) -> None:
        """Wait (FIFO, until `deadline`, time.monotonic) for a slot: OverloadedError after."""
        slots = self._slots
        free = slots._free

        async def acquire() -> None:
            await asyncio.wait_for(free.acquire(), max(0.01, deadline - time.monotonic()))
            # Recorded here, not after `unless_gone` returns: a cancel that comes as the
            # slot is granted drops the return, and the slot must still be given back.
            self._held()

        if not free.locked():  # free and nobody waits ahead: no wait to watch
            await free.acquire()
            self._held()
            return
        try:
            await unless_gone(acquire(), self._client_gone)
        except TimeoutError as exc:
            raise OverloadedError(
                f"All {slots.size} session slots stayed busy for {slots.timeout_s:g} s"
            ) from exc

    def _held(self) -> None:
        self.held = True
        self._slots.in_flight += 1

    def give(self) -> None:
        if self.held:
            self.held = False
            self._slots.in_flight -= 1
            self._slots._free.release()


class KVBudget:
    def __init__(self, total_tokens: int) -> None:
        if total_tokens < 1:
            raise ValueError("a KV budget holds at least one token")
        self.total = total_tokens
        self.reserved = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # `reserved` and the queue change together, from the API's thread and the
        # stage service's.
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return self.total - self.reserved

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_reserve(self, tokens: int) -> bool:
        """Reserve now if it fits and nobody waits ahead; never waits."""
        with self._lock:
            return self._take(tokens)

    def _take(self, tokens: int) -> bool:
        if tokens > self.free or self._waiters:
            return False
        self.reserved += tokens
        return True

    async def reserve(self, tokens: int, timeout_s: float) -> None:
        """Wait (FIFO) until `tokens` fit. ContextLengthError when they never can,
        OverloadedError when the wait passes `timeout_s`."""
        if tokens > self.total:
            raise needs_more_than(tokens, self.total)
        waiter = _Waiter(tokens, asyncio.get_running_loop().create_future())
        with self._lock:
            if self._take(tokens):
                return
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
                with self._lock:
                    queued = waiter in self._waiters
                    if queued:
                        self._waiters.remove(waiter)
                        self._grant()  # the ones behind it may fit now
                if not queued:  # granted just as it gave up: the tokens go back
                    self.release(tokens)

    def release(self, tokens: int) -> None:
        with self._lock:
            self.reserved = max(0, self.reserved - tokens)
            self._grant()

    def _grant(self) -> None:
        """(under the lock) Let in the waiters at the head of the queue that fit now."""
        while self._waiters and self._waiters[0].tokens <= self.free:
            waiter = self._waiters.popleft()
            self.reserved += waiter.tokens
            resolve_soon(waiter.future)  # the tokens are its; its loop may be another thread's


@dataclass(frozen=True)
class PeerLimits:
    """How much of this stage remote coordinators may hold (see `PeerBudget`)."""

    kv_share: float = 0.75  # of the node's KV tokens, all remote sessions together
    peer_kv_share: float = 0.5  # of the node's KV tokens, the sessions of one upstream peer
    max_sessions: int = 64  # remote sessions at once, all peers together
    max_peer_sessions: int = 32  # remote sessions at once from one upstream peer


@dataclass
class _PeerHold:
    sessions: int = 0
    tokens: int = 0


class PeerBudget:
    """Remote stage sessions' own room: a pool inside the node's `KVBudget`, with a cap per
    upstream peer.

    The node's budget stays the one bound on memory, so a remote session's tokens are
    reserved there too; but remote sessions together never hold more than `kv_share` of
    it (the rest is always left to this node's own API requests), one peer never more
    than `peer_kv_share` of it nor `max_peer_sessions` sessions (so one peer opening
    sessions by the hundred cannot starve the other peers), and a remote open never
    jumps ahead of an API request waiting for room (`KVBudget.try_reserve`). Session
    counts are capped as well as tokens: a thousand one-token sessions would otherwise
    fill the worker's session slots. Peers are counted by the peer on the other end of
    the stream (proved by Noise), never by a name a frame gives.
    """

    def __init__(self, node: KVBudget, limits: PeerLimits) -> None:
        self.node = node
        self.limits = limits
        self.total = max(0, int(node.total * limits.kv_share))
        self.per_peer = max(0, int(node.total * limits.peer_kv_share))
        self.reserved = 0
        self._holds: dict[str, _PeerHold] = {}
        self._lock = threading.RLock()  # the stage service changes it, the API reads it

    @property
    def sessions(self) -> int:
        with self._lock:
            return sum(h.sessions for h in self._holds.values())

    @property
    def free(self) -> int:
        """Tokens a new remote session could reserve now (as a record advertises them)."""
        if self.sessions >= self.limits.max_sessions:
            return 0
        return max(0, min(self.total - self.reserved, self.node.free))

    def held_by(self, peer_id: str) -> tuple[int, int]:
        """(sessions, tokens) `peer_id` holds here now."""
        with self._lock:
            hold = self._holds.get(peer_id, _PeerHold())
            return hold.sessions, hold.tokens

    def never_fits(self, tokens: int) -> str | None:
        """Why a remote session of `tokens` can never be held here, however long it waits."""
        if self.limits.max_sessions < 1 or self.limits.max_peer_sessions < 1:
            return "this stage takes no other peer's sessions"
        cap = min(self.total, self.per_peer)
        if tokens > cap:
            return f"a session of {tokens:,} tokens never fits here ({cap:,} for one peer)"
        return None

    def try_reserve(self, peer_id: str, tokens: int) -> str | None:
        """Reserve now, or say why not (a refusal the coordinator routes around)."""
        with self._lock:
            return self._try_reserve(peer_id, tokens)

    def _try_reserve(self, peer_id: str, tokens: int) -> str | None:
        hold = self._holds.get(peer_id, _PeerHold())
        limits = self.limits
        if hold.sessions >= limits.max_peer_sessions:
            return f"this stage holds its {limits.max_peer_sessions} sessions per peer for yours"
        if hold.tokens + tokens > self.per_peer:
            return (
                f"no KV room for {tokens:,} tokens more from one peer "
                f"({hold.tokens:,} of its {self.per_peer:,} held)"
            )
        if self.sessions >= limits.max_sessions:
            return f"all {limits.max_sessions} remote session slots of this stage are busy"
        if self.reserved + tokens > self.total or not self.node.try_reserve(tokens):
            return (
                f"no KV room for {tokens:,} tokens "
                f"({self.free:,} of {self.total:,} free for remote sessions)"
            )
        self.reserved += tokens
        hold.sessions += 1
        hold.tokens += tokens
        self._holds[peer_id] = hold
        return None

    def release(self, peer_id: str, tokens: int) -> None:
        with self._lock:
            hold = self._holds.get(peer_id)
            if hold is None:
                return
            hold.sessions -= 1
            hold.tokens -= tokens
            if hold.sessions <= 0:
                del self._holds[peer_id]
            self.reserved = max(0, self.reserved - tokens)
        self.node.release(tokens)
