"""Locks on a frame's path that cost no scheduler pass when free (applied when a host opens).

Taking a `trio.Lock` is a checkpoint even when nobody holds it: the task yields and trio
runs a whole pass of its scheduler (an epoll poll included) before it goes on. A frame
written and read through py-libp2p 0.8.1 takes some thirteen such locks at each end (the
TCP stream's read and write locks, yamux's window, stream-table and write locks and its
read-write lock, the net stream's state lock, swarmd's own send lock), so a token's hop
paid for a dozen scheduler passes that waited for nothing (issue 17: the hop overhead).

`QuickLock` and `QuickSemaphore` take a free lock at once and fall back to trio's own
`acquire` (with its checkpoint and its fairness) only when they must wait. A cancelled
task is still stopped at the lock, as by trio's. Nothing else changes: the same owner
checks, the same release. Every path these
locks guard still reaches a real checkpoint (the socket's read or write, an event's
wait, a sleep) before it could loop, so no task can spin without yielding. Measured
(`bench/p2p.py`: 2 KB echoed between two processes, trio in a thread as nodes run it,
two runs each): a round trip 0.53 / 0.78 -> 0.44 / 0.44 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["QuickLock", "QuickSemaphore", "apply"]

_MARK = "_swarmd_quick_locks"


class _Quick:
    """What the two share: a trio lock or semaphore, taken at once when free."""

    def __init__(self, inner: trio.Lock | trio.Semaphore) -> None:
        self._inner = inner

    async def acquire(self) -> None:
        # As trio's: a cancelled task is stopped here (before it writes half a frame);
        # only the scheduler pass is left out.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._inner.acquire_nowait()
        except trio.WouldBlock:
            await self._inner.acquire()

    def acquire_nowait(self) -> None:
        self._inner.acquire_nowait()

    def release(self) -> None:
        self._inner.release()

    def statistics(self) -> Any:
        return self._inner.statistics()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class QuickLock(_Quick):
    """A `trio.Lock` whose `acquire` takes it without a scheduler pass when it is free."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        super().__init__(self._lock)

    def locked(self) -> bool:
        return self._lock.locked()


class QuickSemaphore(_Quick):
    """A `trio.Semaphore` whose `acquire` takes a free token without a scheduler pass."""

    def __init__(self, initial_value: int, *, max_value: int | None = None) -> None:
        self._semaphore = trio.Semaphore(initial_value, max_value=max_value)
        super().__init__(self._semaphore)

    @property
    def value(self) -> int:
        return self._semaphore.value

    @property
    def max_value(self) -> int | None:
        return self._semaphore.max_value


def _after_init(cls: type, fix: Callable[[Any], None]) -> None:
    """Run `fix(self)` after `cls.__init__`."""
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        fix(self)

    cls.__init__ = init  # type: ignore[misc]


def _tcp_stream(stream: Any) -> None:
    stream.read_lock = QuickLock()
    stream.write_lock = QuickLock()


def _yamux_stream(stream: Any) -> None:
    stream.window_lock = QuickLock()
    rw_lock = stream.rw_lock
    rw_lock._readers_lock = QuickLock()
    rw_lock._writer_lock = QuickSemaphore(1)


def _yamux(muxer: Any) -> None:
    muxer.streams_lock = QuickLock()
    muxer._write_lock = QuickLock()


def _net_stream(stream: Any) -> None:
    stream._state_lock = QuickLock()


def apply() -> None:
    """Patch py-libp2p's classes once (idempotent): their new instances get quick locks."""
    # Imported here: the locks themselves need only trio (frames.py uses them).
    from libp2p.io import trio as libp2p_trio_io
    from libp2p.network.stream import net_stream
    from libp2p.stream_muxer.yamux import yamux

    if getattr(yamux, _MARK, False):
        return
    _after_init(libp2p_trio_io.TrioTCPStream, _tcp_stream)
    _after_init(yamux.YamuxStream, _yamux_stream)
    _after_init(yamux.Yamux, _yamux)
    _after_init(net_stream.NetStream, _net_stream)
    setattr(yamux, _MARK, True)
