"""`Ring`: the coordinator's end of one session on one route (trio side of the bridge).

`open` dials stage 0 (or this node's own stage service through a local link), sends the
`open` frame that travels down the route, and waits for the last stage's return stream.
`step` sends token ids to stage 0 and waits for the token that comes back round the ring.
Two reader tasks turn what arrives (tokens on the return stream, failure reports from
either end, a link going away) into events; a failure becomes `StageFailedError` naming
the stage to blame:

- a `fail` report names its peer;
- stage 0's link gone without a report: stage 0;
- the return stream gone: the last stage, unless a report arrives within `REPORT_GRACE_S`;
- nothing at all within the step timeout: the first stage that does not answer a ping,
  else nobody in particular (kind "lost", peer None).

The ring never retries: failover is the caller's (`distributed.DistributedChain`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import trio

from swarmd.errors import InternalError, MalformedFrameError, PeerError, StageFailedError
from swarmd.net.rpc import call_ping
from swarmd.pipeline import wire
from swarmd.pipeline.stage_service import REPORT_TIMEOUT_S, Link, StageService

log = logging.getLogger(__name__)

REPORT_GRACE_S = 0.5  # after the return stream breaks, how long to wait for a report
PROBE_TIMEOUT_S = 2.0  # a stage that does not answer a ping this fast is to blame


@dataclass(frozen=True)
class RingTimeouts:
    open_s: float = 20.0  # the whole ring set up: every stage dialed and its cache opened
    step_s: float = 60.0  # one step round the ring


@dataclass(frozen=True)
class _Event:
    source: str  # "up" (stage 0's link), "ret" (the return stream), "ready" (it arrived)
    frame: dict[str, Any] | None  # None: the link ended
    error: str = ""  # why it ended, or why the frame was refused


class Ring:
    def __init__(
        self,
        service: StageService,
        request: wire.OpenRequest,
        timeouts: RingTimeouts,
        vocab_size: int,
    ) -> None:
        self._service = service
        self._req = request
        self._timeouts = timeouts
        self._vocab_size = vocab_size
        self._tx, self._rx = trio.open_memory_channel[_Event](math.inf)
        self._up: Link | None = None
        self._ret: Link | None = None
        self._n = 0
        self._closed = False

    async def open(self) -> None:
        req = self._req
        first, last = req.route[0].peer_id, req.route[-1].peer_id
        self._service.expect_return(req.sid, last, self._return_arrived)
        try:
            self._up = await self._service.dial(first, req.addrs.get(first, ()))
            await self._up.send(wire.open_frame(req))
        except PeerError as exc:
            raise StageFailedError(f"stage {first[-8:]} unreachable: {exc}", first, "lost") from exc
        self._service.spawn(self._read, "up", self._up)
        opened = False
        with trio.move_on_after(self._timeouts.open_s):
            event = await self._rx.receive()
            if event.source != "ready":
                raise await self._failure(event)
            opened = True
        if not opened:
            why = f"the route did not open in {self._timeouts.open_s:g} s"
            raise await self._blame_silence(why)

    async def step(self, token_ids: list[int], want: bool, alone: bool = False) -> wire.TokenReply:
        if self._up is None or self._ret is None:
            raise InternalError("step() on a ring that is not open")
        n = self._n
        inputs = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
        try:
            await self._up.send(wire.step_frame(n, want, inputs, [], 0, alone))
        except PeerError as exc:
            # Stage 0 may have closed its link after reporting a stage behind it: that
            # report, not stage 0, says who failed.
            first = self._req.route[0].peer_id
            lost = StageFailedError(f"stage {first[-8:]} lost: {exc}", first, "lost")
            raise await self._report_or(lost) from exc
        with trio.move_on_after(self._timeouts.step_s):
            event = await self._rx.receive()
            if event.source == "ret" and event.frame is not None:
                kind = event.frame.get("t")
                if kind == "tok":
                    try:
                        reply = wire.parse_token(event.frame, n, self._vocab_size, want)
                    except MalformedFrameError as exc:
                        raise self._bad(self._req.route[-1].peer_id, str(exc)) from exc
                    self._n += 1
                    return reply
            raise await self._failure(event)
        raise await self._blame_silence(f"no token within {self._timeouts.step_s:g} s")

    async def close(self) -> None:
        """End the session on every stage (they free their caches) and drop the links."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if self._up is not None:
                with trio.move_on_after(REPORT_TIMEOUT_S):
                    with contextlib.suppress(PeerError):
                        await self._up.send(wire.END_FRAME, timeout_s=REPORT_TIMEOUT_S)
                await self._up.close()
            self._service.forget_return(self._req.sid)
            self._tx.close()

    # --- events -------------------------------------------------------------------------

    def _return_arrived(self, link: Link) -> None:
        if self._closed:
            return
        self._ret = link
        self._service.spawn(self._read, "ret", link)
        self._tx.send_nowait(_Event("ready", None))

    async def _read(self, source: str, link: Link) -> None:
        """Every frame of one link as an event, then one event for its end."""
        try:
            while not self._closed:
                frame = await link.recv(math.inf)
                self._tx.send_nowait(_Event(source, frame))
        except PeerError as exc:
            if not self._closed:
                self._tx.send_nowait(_Event(source, None, str(exc)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the ring closed while this frame arrived

    async def _report_or(self, default: StageFailedError) -> StageFailedError:
        """A failure report that arrives within REPORT_GRACE_S, else `default`."""
        with trio.move_on_after(REPORT_GRACE_S):
            while True:
                event = await self._rx.receive()
                if event.frame is not None and event.frame.get("t") == "fail":
                    return await self._failure(event)
        return default

    async def _failure(self, event: _Event) -> StageFailedError:
        route = self._req.route
        if event.frame is not None:
            if event.frame.get("t") == "end":  # a stage timed the session out (idle)
                return await self._report_or(
                    StageFailedError("a stage ended the session (idle timeout)", None, "lost")
                )
            if event.frame.get("t") != "fail":
                sender = route[0] if event.source == "up" else route[-1]
                return self._bad(sender.peer_id, f"unexpected {str(event.frame.get('t'))[:10]}")
            try:
                fail = wire.parse_fail(event.frame)
            except MalformedFrameError as exc:
                sender = route[0] if event.source == "up" else route[-1]
                return self._bad(sender.peer_id, str(exc))
            peer = fail.peer_id if fail.peer_id in {h.peer_id for h in route} else None
            return StageFailedError(fail.why, peer, fail.kind)
        # A link broke: a stage may be reporting why (stage 0 closes its link after
        # reporting a stage behind it; the return stream breaks when any stage goes).
        peer = route[0].peer_id if event.source == "up" else route[-1].peer_id
        lost = StageFailedError(f"stage {peer[-8:]} lost: {event.error}", peer, "lost")
        return await self._report_or(lost)

    def _bad(self, peer_id: str, why: str) -> StageFailedError:
        return StageFailedError(f"bad frame from stage {peer_id[-8:]}: {why}", peer_id, "bad")

    async def _blame_silence(self, why: str) -> StageFailedError:
        """Nothing came back: the first stage that does not answer a ping is to blame."""
        for hop in self._req.route:
            if hop.peer_id == self._service.peer_id:
                continue
            try:
                await call_ping(self._service.host, hop.peer_id, PROBE_TIMEOUT_S, rounds=1)
            except PeerError:
                why = f"{why}; stage {hop.peer_id[-8:]} is silent"
                return StageFailedError(why, hop.peer_id, "lost")
        return StageFailedError(why, None, "lost")
