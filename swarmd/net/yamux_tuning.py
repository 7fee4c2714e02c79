"""Two per-frame costs of py-libp2p 0.8.1's yamux, removed (applied when a host opens).

A decode token crosses every link of a ring as one small frame, so what yamux spends per
frame is per-token latency (issue 17: the hop overhead). Two of its habits cost without
buying anything here:

- **A window update for every read.** With its default `PY_YAMUX_RELEASE_ON_READ` on, the
  reader sends a WINDOW_UPDATE frame after each read, so every message costs a second
  encrypted frame back (measured: one update per data frame). Off, credit is returned the
  way go-yamux does it, in batches of half the window, and a sender never waits for
  credit a reader has not used up. Measured by a helper over a relay: 64-byte round
  trips 10.5 -> 3.3 ms relayed, 1.9 -> 1.2 ms direct.
- **A debug line built for every frame written.** `Yamux._write_frame` unpacks the
  header and formats a log message on every call, debug logging on or not; the wrapper
  below does that work only when the library's debug log is on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.stream_muxer.yamux import yamux

_MARK = "_swarmd_tuned"

WriteFrame = Callable[[yamux.Yamux, bytes], Awaitable[None]]


def apply() -> None:
    """Patch the yamux module once (idempotent)."""
    if getattr(yamux, _MARK, False):
        return
    yamux._yamux_release_on_read = _never
    yamux.Yamux._write_frame = _quiet_unless_debug(yamux.Yamux._write_frame)  # type: ignore[method-assign]
    setattr(yamux, _MARK, True)


def _never() -> bool:
    return False


def _quiet_unless_debug(original: WriteFrame) -> WriteFrame:
    logger = logging.getLogger(yamux.__name__)

    async def write_frame(self: yamux.Yamux, data: bytes) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            await original(self, data)
            return
        # The original's lock, write and checkpoint, without its debug line.
        async with self._write_lock:
            await self.secured_conn.write(data)
        await trio.lowlevel.checkpoint()

    return write_frame
