"""`Ring`: the coordinator's end of one session on one route (trio side of the bridge).

`open` dials stage 0 (or this node's own stage service through a local link), sends the
`open` frame that travels down the route, and waits for the last stage's return stream.
`step` sends token ids to stage 0 and waits for the token that comes back round the ring;
`steps` keeps several steps in flight (a prompt's chunks flow through the stages one
behind the other: pipelined prefill).
Two reader tasks turn what arrives (tokens on the return stream, failure reports from
either end, a link going away) into events; a failure becomes `StageFailedError` naming
the stage to blame, on this node's own evidence only:

- a bad frame on one of this node's links: the peer at the other end ("bad");
- stage 0's link gone without a report: stage 0;
- the return stream gone: the last stage, unless a report arrives within `REPORT_GRACE_S`;
- no answer for `stall_s`: the first stage that does not answer a ping (a black-holed
  link shows no error for minutes); while every stage answers, the wait goes on, and at
  the step timeout nobody in particular is to blame (kind "lost", peer None).

A `fail` report is another peer's word, never evidence by itself. A report naming peer Y
is checked: Y not answering a ping is this node's own evidence (Y is to blame, "lost");
Y answering makes it `UnconfirmedReportError`: Y is avoided for this request only. When
the check disproves the report (Y said to be lost answers; a peer not on the route sent
nothing), the reporter - the nearest other peer on the way the report came, the one that
handed it over - is charged with a false report (`report.FalseReports` bans a repeat
offender). A "bad frame" report a ping cannot disprove: Y may feed one neighbour garbage
and answer this node, so that teller is never charged (the neighbour bans Y itself). A
stage naming itself confesses, and is blamed; a report naming this node blames nobody.
A `refused` report fails the request with its 4xx (`InvalidRequestError`, or
`KVRoomError` for 413); a `declined` one leaves its stage out of this request (kind
"busy" when the stage only lacks room now: the chain may wait for it).

The ring never retries: failover is the caller's (`distributed.DistributedChain`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import trio

from swarmd.errors import (
    FrameError,
    InternalError,
    InvalidRequestError,
    KVRoomError,
    MalformedFrameError,
    PeerError,
    RequestError,
    StageFailedError,
    SwarmError,
    UnconfirmedReportError,
)
from swarmd.net.loop_errors import first_of
from swarmd.net.rpc import call_ping
from swarmd.pipeline import wire
from swarmd.pipeline.links import REPORT_TIMEOUT_S, Link

if TYPE_CHECKING:
    from swarmd.pipeline.stage_service import StageService

log = logging.getLogger(__name__)

Step: TypeAlias = tuple[list[int], bool, bool]  # token ids, want a token, attend `alone`

REPORT_GRACE_S = 0.5  # after the return stream breaks, how long to wait for a report
PROBE_TIMEOUT_S = 2.0  # a stage that does not answer a ping this fast is to blame


@dataclass(frozen=True)
class RingTimeouts:
    open_s: float = 20.0  # the whole ring set up: every stage dialed and its cache opened
    step_s: float = 60.0  # one step round the ring
    stall_s: float = 4.0  # a step unanswered this long: are the stages still there?


@dataclass(frozen=True)
class _Event:
    source: str  # "up" (stage 0's link), "ret" (the return stream), "ready" (it arrived)
    frame: dict[str, Any] | None  # None: the link ended
    error: str = ""  # why it ended, or why the frame was refused
    bad: bool = False  # it ended on bytes that were no frame: the sender's fault


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
        self._n = 0  # steps answered
        self._sent = 0  # steps sent
        self._sent_at: deque[float] = deque()  # when each step in flight went out
        self.round_trip_s = 0.0  # the last answered step's, from its sending to its answer
        self._closed = False
        self.reused = 0  # positions every stage resumed from a kept conversation (open)

    @property
    def sid(self) -> str:
        return self._req.sid

    async def open(self) -> None:
        req = self._req
        first, last = req.route[0].peer_id, req.route[-1].peer_id
        self._service.expect_return(req.sid, last, self._return_arrived)
        try:
            self._up = await self._service.dial(first, req.addrs.get(first, ()))
            await self._up.send(wire.open_frame(req))
        except (PeerError, BaseExceptionGroup) as caught:
            exc = first_of(caught, PeerError)
            if exc is None:
                raise
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
        """One step round the ring: its token ids sent, its answer back."""
        await self._send_step(token_ids, want, alone)
        return await self._receive(want)

    async def steps(
        self,
        steps: Sequence[Step],
        window: int,
        before_send: Callable[[], None],
        replied: Callable[[wire.TokenReply], None],
    ) -> None:
        """Several steps (a prompt's chunks, a replay) with up to `window` of them in
        flight: while stage k runs step i, stage k + 1 runs step i - 1, so the links'
        latency is paid about once rather than per step. `before_send()` runs before each
        step goes out (it may raise to stop); `replied(answer)` takes each answer, in order.
        A failure raises as `step` does; the steps answered before it were `replied`."""
        sent = answered = 0
        while answered < len(steps):
            while sent < len(steps) and sent - answered < max(1, window):
                before_send()
                token_ids, want, alone = steps[sent]
                await self._send_step(token_ids, want, alone)
                sent += 1
            replied(await self._receive(steps[answered][1]))
            answered += 1

    async def _send_step(self, token_ids: list[int], want: bool, alone: bool) -> None:
        if self._up is None or self._ret is None:
            raise InternalError("step() on a ring that is not open")
        try:
            # The ids as a list: a coordinator that holds no layers builds no tensor.
            await self._up.send(wire.step_frame(self._sent, want, list(token_ids), [], 0, alone))
        except PeerError as exc:
            # Stage 0 may have closed its link after reporting a stage behind it: that
            # report, not stage 0, says who failed.
            first = self._req.route[0].peer_id
            lost = StageFailedError(f"stage {first[-8:]} lost: {exc}", first, "lost")
            raise await self._report_or(lost) from exc
        self._sent += 1
        self._sent_at.append(time.perf_counter())

    async def _receive(self, want: bool) -> wire.TokenReply:
        """The answer to the oldest step in flight. Past `stall_s` without it, the stages
        are pinged: a silent one (a dead or black-holed link, which TCP does not report
        for minutes) is to blame at once, not at the end of the step timeout; while
        they all answer, the step is only slow (a long prefill) and the wait goes on."""
        n = self._n
        deadline = trio.current_time() + self._timeouts.step_s
        while True:
            wait_until = min(deadline, trio.current_time() + self._timeouts.stall_s)
            with trio.move_on_at(wait_until):
                event = await self._rx.receive()
                if event.source == "ret" and event.frame is not None:
                    kind = event.frame.get("t")
                    if kind == "tok":
                        try:
                            reply = wire.parse_token(event.frame, n, self._vocab_size, want)
                        except MalformedFrameError as exc:
                            raise self._bad(self._req.route[-1].peer_id, str(exc)) from exc
                        self._n += 1
                        self.round_trip_s = time.perf_counter() - self._sent_at.popleft()
                        return reply
                raise await self._failure(event)
            waited = self._timeouts.step_s - (deadline - trio.current_time())
            if trio.current_time() >= deadline:
                raise await self._blame_silence(f"no token within {self._timeouts.step_s:g} s")
            silent = await self._silent_stage()
            if silent is not None:
                why = f"no token in {waited:.0f} s; stage {silent[-8:]} does not answer a ping"
                raise StageFailedError(why, silent, "lost")

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

    def _return_arrived(self, link: Link, ret: wire.Ret) -> None:
        if self._closed:
            return
        self._ret = link
        self.reused = ret.reused or 0
        self._service.spawn(self._read, "ret", link)
        self._tx.send_nowait(_Event("ready", None))

    async def _read(self, source: str, link: Link) -> None:
        """Every frame of one link as an event, then one event for its end."""
        try:
            while not self._closed:
                frame = await link.recv(math.inf)
                self._tx.send_nowait(_Event(source, frame))
        except (PeerError, BaseExceptionGroup) as caught:
            exc = first_of(caught, PeerError)
            if exc is None:
                raise
            if not self._closed:
                bad = isinstance(exc, FrameError)
                self._tx.send_nowait(_Event(source, None, str(exc), bad))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the ring closed while this frame arrived

    async def _report_or(self, default: StageFailedError) -> SwarmError:
        """A failure report that arrives within REPORT_GRACE_S, else `default`."""
        with trio.move_on_after(REPORT_GRACE_S):
            while True:
                event = await self._rx.receive()
                if event.frame is not None and event.frame.get("t") == "fail":
                    return await self._failure(event)
        return default

    async def _failure(self, event: _Event) -> SwarmError:
        """What the ring's failure is: a `StageFailedError` (fail over), or the
        `RequestError` a stage's refusal of the request makes."""
        sender = self._link_peer(event.source)
        if event.frame is not None:
            if event.frame.get("t") == "end":  # a stage timed the session out (idle)
                return await self._report_or(
                    StageFailedError("a stage ended the session (idle timeout)", None, "lost")
                )
            if event.frame.get("t") != "fail":
                return self._bad(sender, f"unexpected {str(event.frame.get('t'))[:10]}")
            try:
                fail = wire.parse_fail(event.frame)
            except MalformedFrameError as exc:
                return self._bad(sender, str(exc))
            return await self._judge(fail, event.source)
        if event.bad:
            return self._bad(sender, event.error)
        # A link broke: a stage may be reporting why (stage 0 closes its link after
        # reporting a stage behind it; the return stream breaks when any stage goes).
        lost = StageFailedError(f"stage {sender[-8:]} lost: {event.error}", sender, "lost")
        return await self._report_or(lost)

    async def _judge(self, fail: wire.Fail, source: str) -> SwarmError:
        """A stage's report, weighed: believed only as far as this node can check it."""
        me = self._service.peer_id
        in_route = {h.peer_id for h in self._req.route}
        named = fail.peer_id if fail.peer_id in in_route and fail.peer_id != me else None
        if fail.kind == "refused":
            return refusal_error(fail)
        if fail.kind == "declined":
            # "busy": no room now, which the chain may wait out. Only a stage of the route
            # (or this node's own) lacks room of its own: naming anyone else is no reason
            # to wait.
            busy = wire.is_busy(fail) and (named is not None or fail.peer_id == me)
            return StageFailedError(fail.why, named, "busy" if busy else "declined")
        reporter = self._reporter(source)
        if fail.peer_id == me or reporter is None:
            return StageFailedError(fail.why, None, fail.kind)  # nothing to check, nobody to ban
        if named == reporter:  # it says it failed itself
            return StageFailedError(fail.why, named, fail.kind)
        if named is not None and not await self._answers_ping(named):
            why = f"{fail.why}; stage {named[-8:]} does not answer a ping"
            return StageFailedError(why, named, "lost")
        # A ping disproves "lost"; a "bad" frame it cannot disprove (the named peer may
        # send garbage to one neighbour and answer this node), so that teller is not charged.
        disproved = named is None or fail.kind == "lost"
        why = f"unconfirmed report from {reporter[-8:]}: {fail.why}"
        return UnconfirmedReportError(why, named, fail.kind, reporter, disproved)

    def _link_peer(self, source: str) -> str:
        """The peer at the other end of this node's link: stage 0, or the last stage."""
        route = self._req.route
        return route[0].peer_id if source == "up" else route[-1].peer_id

    def _reporter(self, source: str) -> str | None:
        """Who handed a report over: the nearest other peer on the side it came from (this
        node's own stage service relays honestly, so past it, its neighbour)."""
        hops = self._req.route if source == "up" else tuple(reversed(self._req.route))
        return next((h.peer_id for h in hops if h.peer_id != self._service.peer_id), None)

    async def _answers_ping(self, peer_id: str) -> bool:
        try:
            await call_ping(self._service.host, peer_id, PROBE_TIMEOUT_S, rounds=1)
        except (PeerError, BaseExceptionGroup) as caught:
            if first_of(caught, PeerError) is None:
                raise
            return False
        return True

    def _bad(self, peer_id: str, why: str) -> StageFailedError:
        return StageFailedError(f"bad frame from stage {peer_id[-8:]}: {why}", peer_id, "bad")

    async def _blame_silence(self, why: str) -> StageFailedError:
        """Nothing came back: the first stage that does not answer a ping is to blame."""
        silent = await self._silent_stage()
        if silent is not None:
            return StageFailedError(f"{why}; stage {silent[-8:]} is silent", silent, "lost")
        return StageFailedError(why, None, "lost")

    async def _silent_stage(self) -> str | None:
        """The first stage of the route (this node aside) that does not answer a ping."""
        for hop in self._req.route:
            if hop.peer_id == self._service.peer_id:
                continue
            if not await self._answers_ping(hop.peer_id):
                return hop.peer_id
        return None


def refusal_error(fail: wire.Fail) -> RequestError:
    """The client's error for a stage's refusal of what the request asked."""
    message = f"A stage of the route refused the request: {fail.why}"
    if fail.status == 413:
        return KVRoomError(message, fail.param)
    return InvalidRequestError(message, fail.param)
