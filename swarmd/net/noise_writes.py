"""Noise writes that a cancellation cannot tear (a fix to py-libp2p 0.8.1, applied at import).

py-libp2p's Noise transport encrypts a message, which spends the next nonce, and then
awaits the socket write. A trio cancellation that lands in that await (a `move_on_after`
around a send, a nursery cancelled while one of its tasks writes) drops the ciphertext
after its nonce was spent: every later message then fails authentication at the peer,
which closes the connection, and every stream on it dies. In swarmd that was one
session's end killing every other session through the same peer (issue 13: eight
concurrent distributed streams, seven ended when the first finished).

The fixed write checks for cancellation *before* it encrypts, so a caller that was
cancelled already loses nothing, and once a message is encrypted it is written under a
shield with its own deadline. A write that misses that deadline leaves the stream of
nonces broken for good, so the connection is closed at once rather than left to fail at
the peer's next read, and every later write on it fails at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.security.noise import io as noise_io

log = logging.getLogger(__name__)

WRITE_DEADLINE_S = 10.0  # one encrypted message onto the socket; longer: the peer is gone
_CLOSE_TIMEOUT_S = 1.0
_MARK = "_swarmd_cancel_safe"
_BROKEN = "_swarmd_write_broken"  # set on a connection whose nonces went out of step

WriteMsg = Callable[..., Awaitable[None]]


def cancel_safe(write_msg: WriteMsg, deadline_s: float = WRITE_DEADLINE_S) -> WriteMsg:
    """`write_msg(self, msg, prefix_encoded=False)` that a cancellation cannot cut in half."""

    @functools.wraps(write_msg)
    async def wrapped(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        if getattr(self, _BROKEN, False):
            # Fail at once: every later write would wait out its own deadline (libp2p's
            # shielded cleanups write resets one after another).
            raise trio.BrokenResourceError("Noise connection already broken")
        await trio.lowlevel.checkpoint_if_cancelled()  # before a nonce is spent
        written = False
        with trio.move_on_after(deadline_s, shield=True):
            await write_msg(self, msg, prefix_encoded)
            written = True
        if not written:
            setattr(self, _BROKEN, True)
            log.warning("a Noise write took over %g s: connection closed", deadline_s)
            with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                await self.read_writer.close()
            raise trio.BrokenResourceError(f"Noise write not done in {deadline_s:g} s")

    setattr(wrapped, _MARK, True)
    return wrapped


def apply() -> None:
    """Install the fix on py-libp2p's Noise transport (once; later calls do nothing)."""
    cls = noise_io.BaseNoiseMsgReadWriter
    if not getattr(cls.write_msg, _MARK, False):
        cls.write_msg = cancel_safe(cls.write_msg)  # type: ignore[method-assign]
