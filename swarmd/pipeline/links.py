"""The frame links of the stage protocol, without torch (a coordinator's ring uses them).

`Link` is a frame stream to one peer: a libp2p `FrameStream`, or a `LoopLink`, the
in-memory pair that joins two parts of this node (a route through this node itself).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import trio

from swarmd.errors import RecvTimeoutError, StreamClosedError

REPORT_TIMEOUT_S = 1.0  # a failure report is best effort: never wait long to send it


class Link(Protocol):
    """A frame stream to one peer: `FrameStream`, or a `LoopLink` to this node."""

    peer_id: str

    async def send(self, obj: dict[str, Any], timeout_s: float | None = None) -> None: ...

    async def recv(self, timeout_s: float) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class LoopLink:
    """One end of an in-memory link between two parts of this node (same frames)."""

    def __init__(
        self,
        peer_id: str,
        tx: trio.MemorySendChannel[dict[str, Any]],
        rx: trio.MemoryReceiveChannel[dict[str, Any]],
    ) -> None:
        self.peer_id = peer_id
        self._tx, self._rx = tx, rx

    @classmethod
    def pair(cls, peer_id: str) -> tuple[LoopLink, LoopLink]:
        a_tx, b_rx = trio.open_memory_channel[dict[str, Any]](math.inf)
        b_tx, a_rx = trio.open_memory_channel[dict[str, Any]](math.inf)
        return cls(peer_id, a_tx, a_rx), cls(peer_id, b_tx, b_rx)

    async def send(self, obj: dict[str, Any], timeout_s: float | None = None) -> None:
        try:
            self._tx.send_nowait(obj)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosedError("local link closed", self.peer_id) from exc

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            with trio.fail_after(timeout_s):
                return await self._rx.receive()
        except trio.TooSlowError:
            raise RecvTimeoutError(f"no frame in {timeout_s:g} s", self.peer_id) from None
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise StreamClosedError("local link closed", self.peer_id) from exc

    async def close(self) -> None:
        await self._tx.aclose()
        await self._rx.aclose()
