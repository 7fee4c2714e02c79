"""`StageService`: this node's end of the stage protocol (trio side of the bridge).

It serves `/swarmd/stage/1`. A stream that starts with `open` is one session of one
route through this node, for one of the models it holds layers of (`HeldStage`: a node
holds several, one or none; the open names its model). The service opens a KV cache for
it, dials the next stage (or, on the last stage, the coordinator), forwards the `open`,
and then, per step, checks the input, runs its layers on that model's torch worker and
sends the result on. A stream that starts
with `ret` is a last stage's answer stream for a ring this node coordinates; it is handed
to that ring (`expect_return`).

A session ends on `end`, when its upstream is idle past `idle_timeout_s`, when either
neighbour goes away, or on a failure; in every case its cache is freed (a must-run job on
the worker) and the next stage's stream is closed, so the whole ring unwinds. Failures are
reported towards the coordinator in both directions (see `wire`), and a peer that sent
garbage is banned.

Limits per peer: another peer's sessions draw on `PeerBudget` (a part of the node's KV
budget, capped per peer and in all); a session nobody steps is freed soon after its open
timeout; the next stage is dialed only on addresses its signed record lists, within one
open timeout, and a dial that fails is reported without its error (`UNREACHABLE`).

`dial` also gives the coordinator its links: a peer's stream, or, for this node itself,
an in-memory `LoopLink` to this same service, so a route through the coordinator's own
layers runs the same code.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias

import trio

from swarmd.errors import (
    DialError,
    FrameError,
    InternalError,
    MalformedFrameError,
    OverloadedError,
    PeerError,
    RecvTimeoutError,
    StageRefusedError,
    StreamClosedError,
    SwarmError,
)
from swarmd.model.jobs import CloseJob, Job, OpenJob, StepJob
from swarmd.net.host import P2PHost
from swarmd.net.loop_errors import first_of
from swarmd.pipeline import wire
from swarmd.pipeline.admission import KVBudget, PeerBudget, PeerLimits
from swarmd.pipeline.links import REPORT_TIMEOUT_S, Link, LoopLink

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RunJob = Callable[[Job, float], Awaitable[Any]]
"""`await run(job, timeout_s)`: run a job on the torch worker, from trio."""

Ban = Callable[[str, str], Awaitable[None]]

SignedAddrs = Callable[[str, bool], Awaitable[frozenset[str] | None]]
"""`await signed_addrs(peer_id, fresh)`: the addresses that peer's signed record lists (None:
no record known); from the records known already, or, `fresh`, from a lookup. The only
addresses a next hop is dialed on."""

LEAVING = "this node is shutting down"

# All a failure report says of a next stage this stage could not reach: the dial's error
# (refused, timed out, wrong peer) would make an `open` frame a port scanner.
UNREACHABLE = "next stage unreachable"


@dataclass(frozen=True)
class StageTimeouts:
    open_s: float = 10.0  # the first frame of a stream; dialing the next stage
    idle_s: float = 120.0  # a session with no frame from upstream this long is freed
    step_s: float = 60.0  # one model step on the worker


@dataclass(frozen=True)
class HeldStage:
    """One model this node holds layers of, as the stage protocol serves it."""

    limits: wire.StageLimits
    dtype: torch.dtype  # what its layers take hidden states in (received ones are cast)
    run: RunJob  # its torch worker
    budget: KVBudget  # its KV tokens, which this node's own sessions reserve
    peers: PeerBudget  # the part of them other peers' sessions may hold

    @classmethod
    def of(
        cls,
        limits: wire.StageLimits,
        dtype: torch.dtype,
        run: RunJob,
        budget: KVBudget,
        peers: PeerBudget | None = None,
    ) -> HeldStage:
        """`peers` defaults to `PeerLimits()` of `budget`."""
        return cls(limits, dtype, run, budget, peers or PeerBudget(budget, PeerLimits()))


@dataclass
class PendingReturn:
    """A ring waiting for its last stage's answer stream."""

    peer_id: str  # the only peer allowed to send it
    arrived: Callable[[Link, wire.Ret], None]  # called once, with the stream, when it comes
    done: trio.Event = field(default_factory=trio.Event)  # the ring no longer needs it
    link: Link | None = None


class StageService:
    def __init__(
        self,
        host: P2PHost,
        stages: list[HeldStage],
        ban: Ban,
        timeouts: StageTimeouts,
        signed_addrs: SignedAddrs | None = None,
    ) -> None:
        """`stages`: the models this node holds layers of (none: it only coordinates, and
        takes its rings' return streams); `signed_addrs`: the peers' signed addresses
        (None: a next hop is reached only over a connection this node already has)."""
        self.host = host
        self.timeouts = timeouts
        self.stages = {stage.limits.model_id: stage for stage in stages}
        self._ban = ban
        self._signed_addrs = signed_addrs
        self._pending: dict[str, PendingReturn] = {}
        self._nursery: trio.Nursery | None = None
        # Other peers' sessions open here, by session id: their upstream links, which a
        # leaving node tells first (`leave`).
        self._sessions: dict[str, Link] = {}
        self._leaving = False
        self._no_sessions = trio.Event()  # set once a leaving node's sessions have ended
        host.set_handler(wire.STAGE_PROTOCOL, self._serve)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    async def run(self) -> None:
        """Own the tasks of local links and rings; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()

    async def leave(self, grace_s: float) -> int:
        """A clean shutdown: tell every other peer's session here that this stage is
        leaving, so its coordinator fails over at once and bans nobody (a stream that just
        closed reads as a lost stage, which is banned), and decline new ones; wait up to
        `grace_s` for the sessions to end. Returns how many were told."""
        self._leaving = True
        told = dict(self._sessions)
        if not told:
            self._no_sessions.set()
            return 0
        log.info("leaving: telling %d sessions' coordinators", len(told))
        frame = wire.fail_frame(self.peer_id, LEAVING, "declined")
        async with trio.open_nursery() as nursery:
            for up in told.values():
                nursery.start_soon(_report, up, frame)
        with trio.move_on_after(grace_s):
            await self._no_sessions.wait()
        return len(told)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._nursery is None:
            raise InternalError("the stage service is not running")
        self._nursery.start_soon(fn, *args)

    # --- links ---------------------------------------------------------------------------

    async def dial(self, peer_id: str, addrs: tuple[str, ...] = ()) -> Link:
        """A link to a peer's stage service (this node: an in-memory one)."""
        if peer_id == self.peer_id:
            mine, theirs = LoopLink.pair(peer_id)
            self.spawn(self._serve_local, theirs)
            return mine
        if peer_id not in self.host.connected_peers():
            await self._connect(peer_id, addrs)
        try:
            return await self.host.open_stream(peer_id, wire.STAGE_PROTOCOL, self.timeouts.open_s)
        except DialError:
            if not addrs:
                raise
        # libp2p can keep listing a connection that has died ("no valid connections"):
        # drop it and dial the addresses the route gave.
        await self.host.disconnect(peer_id)
        await self._connect(peer_id, addrs)
        return await self.host.open_stream(peer_id, wire.STAGE_PROTOCOL, self.timeouts.open_s)

    async def _connect(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        for addr in addrs:
            try:
                await self.host.connect(addr, self.timeouts.open_s)
                return
            except PeerError as exc:
                log.debug("dial %s via %s failed: %s", peer_id[-8:], addr, exc)

    def expect_return(
        self, sid: str, last_peer_id: str, arrived: Callable[[Link, wire.Ret], None]
    ) -> None:
        """Hand the return stream of ring `sid`, when `last_peer_id` opens it, to `arrived`."""
        self._pending[sid] = PendingReturn(last_peer_id, arrived)

    def forget_return(self, sid: str) -> None:
        pending = self._pending.pop(sid, None)
        if pending is not None:
            pending.done.set()

    async def _serve_local(self, link: LoopLink) -> None:
        try:
            await self._serve(link)
        except SwarmError as exc:
            log.debug("local stage session ended: %s", exc)
        finally:
            await link.close()

    # --- serving -------------------------------------------------------------------------

    async def _serve(self, up: Link) -> None:
        first = await up.recv(self.timeouts.open_s)
        kind = wire.frame_type(first)
        if kind == "ret":
            await self._attach_return(up, wire.parse_ret(first))
        elif kind == "open":
            await self._serve_session(up, first)
        else:
            raise MalformedFrameError(f"a stage stream starts with open or ret, not {kind}")

    async def _attach_return(self, link: Link, ret: wire.Ret) -> None:
        pending = self._pending.get(ret.sid)
        if pending is None or pending.link is not None or pending.peer_id != link.peer_id:
            log.debug("return stream for unknown ring %s from %s", ret.sid, link.peer_id[-8:])
            return  # a ring that gave up already, or not this peer's: close it
        pending.link = link
        pending.arrived(link, ret)
        await pending.done.wait()  # the stream stays open while the ring reads it

    async def _serve_session(self, up: Link, first: dict[str, Any]) -> None:
        named = first.get("model")
        stage = self.stages.get(named) if isinstance(named, str) else None
        try:
            if stage is None:  # checked whole by the stage that holds it, if any
                raise StageRefusedError(f"this node does not serve model '{str(named)[:80]}'")
            req = wire.parse_open(first, stage.limits)  # its history within its max_len too
        except StageRefusedError as exc:  # declined, or refused for what the request asked
            await _report(up, wire.refusal_frame(self.peer_id, exc))
            return
        except MalformedFrameError as exc:
            await self._bad_upstream(up, None, exc, "?")
            return
        if self._leaving:
            await _report(up, wire.fail_frame(self.peer_id, LEAVING, "declined"))
            return
        refused = self._reserve(stage, up.peer_id, req.max_length)
        if refused is not None:
            why, busy = refused
            # Busy (no room now, no failure): the coordinator tries another holder or
            # waits. Else no wait could help, and it routes around this stage.
            if busy:
                await _report(up, wire.busy_frame(self.peer_id, why))
            else:
                await _report(up, wire.fail_frame(self.peer_id, why, "declined"))
            return
        remote = up.peer_id != self.peer_id  # this node's own routes end with it anyway
        if remote:
            self._sessions[req.sid] = up
        try:
            await self._open_and_run(stage, up, req)
        finally:
            self._sessions.pop(req.sid, None)
            if self._leaving and not self._sessions:
                self._no_sessions.set()
            self._release(stage, up.peer_id, req.max_length)

    def _reserve(self, stage: HeldStage, peer_id: str, tokens: int) -> tuple[str, bool] | None:
        """Room for a session, or why not and whether it is only busy (not even an idle
        node could hold it otherwise). This node's own sessions (its routes through its
        own layers, on a `LoopLink`) draw on its budget; another peer's on the peers' part."""
        if peer_id != self.peer_id:
            never = stage.peers.never_fits(tokens)
            if never is not None:
                return never, False
            why = stage.peers.try_reserve(peer_id, tokens)
            return None if why is None else (why, True)
        budget = stage.budget
        if tokens > budget.total:
            never = f"a session of {tokens:,} tokens never fits here ({budget.total:,} in all)"
            return never, False
        if budget.try_reserve(tokens):
            return None
        return f"no KV room for {tokens:,} tokens ({budget.free:,} of {budget.total:,} free)", True

    def _release(self, stage: HeldStage, peer_id: str, tokens: int) -> None:
        if peer_id != self.peer_id:
            stage.peers.release(peer_id, tokens)
        else:
            stage.budget.release(tokens)

    async def _open_and_run(self, stage: HeldStage, up: Link, req: wire.OpenRequest) -> None:
        sid = req.sid
        opening = OpenJob(
            sid,
            req.max_length,
            req.sampling if req.is_last else None,
            req.history,
            req.me.layers,
            resume=None if req.resume is None else (_kept_key(req, req.resume[0]), req.resume[1]),
            keep_as=_kept_key(req, sid) if req.keep else None,
            copy=req.copy,
            ring=len(req.route),
        )
        refused = False
        try:
            try:
                reused = await stage.run(opening, self.timeouts.step_s)
            except (OverloadedError, InternalError) as exc:  # no slot, or a duplicate sid
                refused = True  # nothing of this stream's to free (nor another's to touch)
                if isinstance(exc, OverloadedError):
                    await _report(up, wire.busy_frame(self.peer_id, str(exc)))
                else:
                    await _report(up, wire.fail_frame(self.peer_id, str(exc), "declined"))
                return
            if req.resume is not None and reused != req.resume[1]:
                req = replace(req, resume=None)  # the stages after this one prefill too
            await self._run_session(stage, up, req)
        finally:
            # Also when cancelled or timed out while the open was running: the cache it
            # made is freed (the close queues behind it).
            if not refused:
                with trio.CancelScope(shield=True):
                    await stage.run(CloseJob(sid), self.timeouts.step_s)

    async def _run_session(self, stage: HeldStage, up: Link, req: wire.OpenRequest) -> None:
        nxt = req.next_peer
        try:
            # One deadline for the whole way there: every address, the redial, the stream.
            with trio.fail_after(self.timeouts.open_s):
                addrs = await self._next_hop_addrs(nxt, req.addrs.get(nxt, ()))
                if addrs is None:
                    # Addresses its signed record does not list: never dialed. The
                    # coordinator routes around the hop for this request; nobody is banned.
                    _session_failed(req.sid, nxt, "its addresses are not in its signed record")
                    await _report(up, wire.fail_frame(nxt, UNREACHABLE, "declined"))
                    return
                down = await self.dial(nxt, addrs)
        except (PeerError, trio.TooSlowError) as exc:
            _session_failed(req.sid, nxt, f"cannot reach the next stage: {exc!s:.300}")
            await _report(up, wire.fail_frame(nxt, UNREACHABLE, "lost"))
            return
        try:
            hello = (
                wire.ret_frame(req.sid, _resumed(req))
                if req.is_last
                else wire.open_frame(replace(req, hop=req.hop + 1))
            )
            await down.send(hello)
            inbox_tx, inbox = trio.open_memory_channel[_Arrival](MAX_STEPS_AHEAD)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_downstream, up, down, nursery.cancel_scope)
                nursery.start_soon(_read_ahead, up, inbox_tx)
                await self._forward(stage, up, inbox, down, req)
                nursery.cancel_scope.cancel()
        except (PeerError, BaseExceptionGroup) as caught:  # the next stage is gone
            # A nursery wraps what its tasks raise in a group: find the real error.
            exc = first_of(caught, PeerError)
            if exc is None:
                raise
            _session_failed(req.sid, nxt, f"the next stage is gone: {exc}")
            await _report(up, wire.fail_frame(nxt, f"stage {nxt[-8:]} lost: {exc}", "lost"))
        finally:
            await down.close()

    async def _next_hop_addrs(self, peer_id: str, named: tuple[str, ...]) -> tuple[str, ...] | None:
        """The addresses of `named` this stage may dial for the next hop; None when the open
        is to be refused: one its signed record does not list, or no record to check."""
        if peer_id == self.peer_id or not named:
            return ()  # an in-memory link, or whatever libp2p already knows of the peer
        if peer_id in self.host.connected_peers():
            return ()  # the connection it has: the frame's addresses are not dialed
        if self._signed_addrs is None:
            return None
        signed = await self._signed_addrs(peer_id, False)
        if signed is None or not set(named) <= signed:
            signed = await self._signed_addrs(peer_id, True)  # unknown, or it moved on
        return named if signed is not None and set(named) <= signed else None

    def _first_step_s(self, req: wire.OpenRequest) -> float:
        """How long a new session waits for its first step: the ring's open, then the
        stages before this one computing the first chunk. A session nobody steps (its
        coordinator vanished, or its open timed out further down) is freed after this."""
        return 2 * self.timeouts.open_s + req.hop * self.timeouts.step_s

    async def _forward(
        self,
        stage: HeldStage,
        up: Link,
        inbox: trio.MemoryReceiveChannel[_Arrival],
        down: Link,
        req: wire.OpenRequest,
    ) -> None:
        """Steps from upstream (read ahead into `inbox`), through this stage, on
        downstream; until the session ends."""
        n = 0
        while True:
            wait_s = (
                self.timeouts.idle_s if n else min(self.timeouts.idle_s, self._first_step_s(req))
            )
            try:
                frame = await _next(inbox, up.peer_id, wait_s)
            except RecvTimeoutError:
                log.info("stage session %s idle for %g s: freed", req.sid, wait_s)
                await _report(down, wire.END_FRAME)
                return
            except StreamClosedError as exc:  # gone without `end`
                if self._leaving:  # its coordinator was told why (`leave`) and let go
                    await _report(down, wire.END_FRAME)  # the stages after end quietly
                    return
                _session_failed(req.sid, up.peer_id, f"the previous hop is gone: {exc}")
                why = f"stage {up.peer_id[-8:]} lost: {exc}"
                await _report(down, wire.fail_frame(up.peer_id, why, "lost"))
                return
            except FrameError as exc:  # garbage bytes from upstream: its fault, not the next's
                await self._bad_upstream(up, down, _as_malformed(exc), req.sid)
                return
            try:
                kind = wire.frame_type(frame)
                if kind == "end":
                    await _report(down, wire.END_FRAME)
                    return
                if kind == "fail" and req.hop > 0:  # an upstream failure: pass it on
                    await _report(down, _relayed(frame))
                    return
                if kind != "step":
                    raise MalformedFrameError(f"a {kind} frame inside a session")
                step = wire.parse_step(frame, n, req.hop == 0, stage.limits, stage.dtype)
            except MalformedFrameError as exc:
                await self._bad_upstream(up, down, exc, req.sid)
                return
            try:
                result = await stage.run(
                    StepJob(req.sid, step.inputs, step.want), self.timeouts.step_s
                )
            except SwarmError as exc:  # this stage's own failure (timeout, context, bug)
                failed = wire.fail_frame(self.peer_id, f"step failed: {exc}", "lost")
                await _report(up, failed)
                await _report(down, failed)
                return
            stage_ms = [*step.stage_ms, result.compute_s * 1000.0]
            if req.is_last:
                out = wire.token_frame(
                    n, result.token, stage_ms, step.activation_bytes, result.logprobs
                )
            else:
                out = wire.step_frame(
                    n, step.want, result.hidden, stage_ms, step.activation_bytes, step.alone
                )
            await down.send(out)
            n += 1

    async def _watch_downstream(self, up: Link, down: Link, scope: trio.CancelScope) -> None:
        """Failure reports from downstream go upstream; so does the loss of the next stage."""
        try:
            frame = await _recv(down, math.inf)
            if wire.frame_type(frame) != "fail":
                raise MalformedFrameError("only fail frames travel upstream")
            await _report(up, _relayed(frame))
        except FrameError as exc:  # not only a bad field: bytes that are no frame at all
            why = f"bad frame from stage {down.peer_id[-8:]}: {exc}"
            await _report(up, wire.fail_frame(down.peer_id, why, "bad"))
            await self._ban_peer(down.peer_id, why)
        except PeerError as exc:
            why = f"stage {down.peer_id[-8:]} lost: {exc}"
            await _report(up, wire.fail_frame(down.peer_id, why, "lost"))
        scope.cancel()

    async def _bad_upstream(
        self, up: Link, down: Link | None, exc: MalformedFrameError, sid: str
    ) -> None:
        why = f"bad frame from {up.peer_id[-8:]}: {exc}"
        log.warning(
            "DIAG: stage rejected a frame request_id=%s peer=%s: %s",
            request_id_of(sid),
            up.peer_id[-8:],
            exc,
        )
        if down is not None:
            await _report(down, wire.fail_frame(up.peer_id, why, "bad"))
        await self._ban_peer(up.peer_id, why)

    async def _ban_peer(self, peer_id: str, why: str) -> None:
        if peer_id != self.peer_id:
            await self._ban(peer_id, why)


# A frame from upstream, or why none will come (the link's error).
_Arrival: TypeAlias = "dict[str, Any] | PeerError"

# Steps read from upstream before this stage has run them. A coordinator keeps up to one
# step per stage in flight (pipelined prefill), so while this stage computes, the next
# ones are read off the stream at once: yamux lets a sender wait for a reader only 5 s.
MAX_STEPS_AHEAD = 16


async def _read_ahead(up: Link, inbox: trio.MemorySendChannel[_Arrival]) -> None:
    """Frames from upstream into `inbox` as they arrive (it holds MAX_STEPS_AHEAD: past
    that the reading waits), until the session's last frame or the link's end."""
    async with inbox:
        while True:
            try:
                frame = await _recv(up, math.inf)
            except PeerError as exc:
                await inbox.send(exc)
                return
            await inbox.send(frame)
            if isinstance(frame, dict) and frame.get("t") in ("end", "fail"):
                return  # nothing comes after these: no read left waiting to be cancelled


async def _next(
    inbox: trio.MemoryReceiveChannel[_Arrival], peer_id: str, timeout_s: float
) -> dict[str, Any]:
    """The next frame from upstream; its link's error raised; RecvTimeoutError when none
    comes within `timeout_s`."""
    with trio.move_on_after(timeout_s):
        try:
            arrival = await inbox.receive()
        except trio.EndOfChannel:
            raise StreamClosedError("the previous hop's link ended", peer_id) from None
        if isinstance(arrival, PeerError):
            raise arrival
        return arrival
    raise RecvTimeoutError(f"no frame in {timeout_s:g} s", peer_id)


async def _recv(link: Link, timeout_s: float) -> dict[str, Any]:
    """`link.recv`, with the peer error inside an exception group (a stream that reads in a
    nursery of its own) raised as itself, so the handler for that error sees it."""
    try:
        return await link.recv(timeout_s)
    except BaseExceptionGroup as group:
        exc = first_of(group, PeerError)
        if exc is None:
            raise
        raise exc from group


def _as_malformed(exc: FrameError) -> MalformedFrameError:
    if isinstance(exc, MalformedFrameError):
        return exc
    return MalformedFrameError(str(exc), exc.peer_id)


def _relayed(frame: dict[str, Any]) -> dict[str, Any]:
    """A failure report from another stage, checked, to pass on toward the coordinator."""
    return wire.relay_frame(frame)


def _kept_key(req: wire.OpenRequest, sid: str) -> str:
    """Where a route's stage keeps a finished session's cache: under its coordinator, so
    that only the coordinator of a conversation resumes it (the sid, a fresh uuid, is
    known to the route's peers only)."""
    return f"{req.coordinator}/{sid}"


def _resumed(req: wire.OpenRequest) -> int | None:
    """What the last stage's `ret` says of a resume: None when none was asked, else the
    positions every stage took (`resume` travels on only from a stage that took them)."""
    if not req.keep and req.resume is None:
        return None
    return 0 if req.resume is None else req.resume[1]


def request_id_of(sid: str) -> str:
    """A session id is `<request id>.<attempt>`: the coordinator's request id first."""
    return sid.rsplit(".", 1)[0]


def _session_failed(sid: str, peer_id: str, why: str) -> None:
    log.warning(
        "DIAG: stage session failed request_id=%s sid=%s peer=%s: %s",
        request_id_of(sid),
        sid,
        peer_id[-8:],
        why,
    )


async def _report(link: Link, frame: dict[str, Any]) -> None:
    """Send a frame that is only a courtesy (end, failure report); never fail for it."""
    try:
        with trio.move_on_after(REPORT_TIMEOUT_S):
            await link.send(frame, timeout_s=REPORT_TIMEOUT_S)
    except SwarmError as exc:
        log.debug("report to %s not sent: %s", link.peer_id[-8:], exc)
