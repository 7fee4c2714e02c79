"""`DistributedChain`: a route over several peers, with failover (asyncio side).

It is the `StageChain` of a distributed request. Each session runs on a `Ring` (trio,
reached through the bridge). When a stage fails, the failover is the small algorithm of
STYLE habit 8:

1. ban the peer to blame, on this node's own evidence only (with the peer table's
   growing backoff); a peer another stage's unconfirmed report named is only left out of
   this request, and the teller of a report that proved false is charged
   (`report.FalseReports`: a repeat offender is the one banned);
2. re-route only the broken range (`route.replan`: its standby, else any other holder);
3. rebuild the session on the new route by replaying every step fed so far, as it was
   fed (the prompt's chunks, then each reply token; the last stage's sampler is told the
   reply tokens so penalties stay right), then retry the step that failed.

A stage that is busy (no room for the request now) is no failure: another holder of its
range with room takes it, else the request waits in the node's `RoomQueue` and tries the
same holders again, until its deadline (`RouteBusyError`). A stage that declined for any
other reason is left out of the request.

At most `max_failovers` times per request; then `RouteFailedError`. When nobody holds a
range any more, `NoRouteError` names the missing layers. A stage that refused what the
request asked ends the request with that 4xx at once (the ring raises a `RequestError`):
no failover, nobody banned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from swarmd.dht.records import NodeRecord
from swarmd.errors import (
    InternalError,
    NoRouteError,
    RouteBusyError,
    RouteFailedError,
    StageFailedError,
    UnconfirmedReportError,
)
from swarmd.model.sampling import Sampled, SamplingParams
from swarmd.net.loop_errors import first_of
from swarmd.net.relay import is_circuit
from swarmd.pipeline import bounds, wire
from swarmd.pipeline.admission import SessionSlot, needs_more_than
from swarmd.pipeline.chain import Hop
from swarmd.pipeline.kept import KeptConversations, Resume
from swarmd.pipeline.report import FalseReports
from swarmd.pipeline.ring import Ring, RingTimeouts
from swarmd.pipeline.room import RoomQueue, Ticket
from swarmd.pipeline.route import Route, plan_route, replan
from swarmd.pipeline.stage_service import StageService

log = logging.getLogger("swarmd.requests")

T = TypeVar("T")


class SwarmAccess(Protocol):
    """What a distributed chain needs from its node."""

    @property
    def peer_id(self) -> str: ...

    @property
    def stage_service(self) -> StageService: ...

    async def holders(self, model_id: str) -> list[NodeRecord]: ...

    def rtt_ms(self) -> dict[str, float]: ...

    def layer_ms(self) -> dict[str, float]:
        """Measured milliseconds per layer per token, by peer (fresh samples only)."""
        ...

    def measured(self, peer_id: str, layer_ms: float) -> None:
        """A decode step ran through `peer_id` at `layer_ms` milliseconds per layer."""
        ...

    def banned(self) -> set[str]: ...

    def sitting_out(self) -> set[str]:
        """Peers lost lately (`SwarmPresence.lose`): routes leave them out while others
        can serve."""
        ...

    async def answering(self, peer_ids: set[str]) -> set[str]:
        """Of these sitting-out peers, those that answer a ping now (their period ends)."""
        ...

    def listen_addrs(self) -> list[str]: ...

    async def ban(self, peer_id: str, reason: str) -> None: ...

    async def lose(self, peer_id: str, reason: str) -> None: ...

    async def in_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...


@dataclass(frozen=True)
class ChainSettings:
    model_id: str
    num_layers: int
    vocab_size: int
    chunk_tokens: int  # a replay feeds reply tokens in chunks of this many
    max_failovers: int
    timeouts: RingTimeouts


async def plan(
    access: SwarmAccess, settings: ChainSettings, need_tokens: int, sampling: SamplingParams
) -> tuple[Route, list[NodeRecord]]:
    """The best route for a new request and the holders' records it came from.

    NoRouteError when the holders do not cover every layer. When they do, but no holder
    of some layers announces room for the request now, the route ignores the room they
    announce: their own admission decides (a record's free tokens lag behind), and a
    stage without room declines, which the chain waits out (`DistributedChain`).
    """
    records = await holders_for(access, settings.model_id, sampling)
    banned = access.banned()
    # A holder lost lately is counted on here: if no route does without it, it is asked.
    holds = route_capacity(records, settings.num_layers, banned)
    if holds is not None and need_tokens > holds:
        raise needs_more_than(need_tokens, holds)
    out = access.sitting_out() - banned
    try:
        return _plan_any_room(access, settings, records, banned | out, need_tokens), records
    except NoRouteError:
        # Only a lost holder has those layers: one that answers again is back (a home
        # network that dropped for a minute must not cost its layers a longer outage).
        back = await _asked_back(access, records, out)
        if not back:
            raise
        log.info("lost holder(s) %s answer again: routed", ",".join(p[-8:] for p in back))
        return _plan_any_room(
            access, settings, records, banned | (out - back), need_tokens
        ), records


async def _asked_back(access: SwarmAccess, records: list[NodeRecord], out: set[str]) -> set[str]:
    """Of the lost peers `out`, the holders in `records` that answer a ping now."""
    asked = {r.peer_id for r in records if r.peer_id in out}
    return await access.answering(asked) if asked else set()


def _plan_any_room(
    access: SwarmAccess,
    settings: ChainSettings,
    records: list[NodeRecord],
    banned: set[str],
    need_tokens: int,
) -> Route:
    """The best route over holders with room now, else over those that could take it."""
    try:
        return _plan(access, settings, records, banned, need_tokens)
    except NoRouteError:
        return _plan(access, settings, records, banned, need_tokens, ignore_room=True)


def _plan(
    access: SwarmAccess,
    settings: ChainSettings,
    records: list[NodeRecord],
    banned: set[str],
    need_tokens: int,
    ignore_room: bool = False,
) -> Route:
    """The best route; `ignore_room`: over the holders whose budget could take
    `need_tokens` once they have room, whatever room they announce now (NoRouteError when
    nobody such holds some layers: busy holders are no reason to wait for one that could
    never take it)."""
    if ignore_room:
        records = [r for r in records if r.kv_budget_tokens >= need_tokens]
    return plan_route(
        settings.model_id,
        settings.num_layers,
        access.peer_id,
        records,
        rtt_ms=access.rtt_ms(),
        layer_ms=access.layer_ms(),
        banned=banned,
        need_tokens=0 if ignore_room else need_tokens,
    )


async def holders_for(
    access: SwarmAccess, model_id: str, sampling: SamplingParams
) -> list[NodeRecord]:
    """The holders of `model_id` whose stages read what this request's open frame carries
    (a stage of an older swarmd would refuse it and ban this node)."""
    records = await access.holders(model_id)
    return [r for r in records if wire.reads_sampling(r.version, sampling)]


def route_capacity(records: list[NodeRecord], num_layers: int, banned: set[str]) -> int | None:
    """The longest session any route over these holders could take: per layer the largest
    KV budget among its holders, the smallest of those over the layers (None: a layer has
    no holder, which planning reports)."""
    best = [0] * num_layers
    for record in records:
        if record.peer_id in banned:
            continue
        for layer in range(max(0, record.layer_start), min(num_layers, record.layer_end)):
            best[layer] = max(best[layer], record.kv_budget_tokens)
    return None if not best or min(best) == 0 else min(best)


def _hops(route: Route, records: list[NodeRecord]) -> list[Hop]:
    """The route's hops, each marked relayed when its peer announces only addresses
    through a relay (it takes no inbound connection); this node's own stage never is."""
    addrs = {r.peer_id: r.addrs for r in records}
    return [
        Hop(s.peer_id[-8:], s.layers, not s.local and _behind_relay(addrs.get(s.peer_id, ())))
        for s in route.stages
    ]


def _behind_relay(addrs: tuple[str, ...]) -> bool:
    return bool(addrs) and all(is_circuit(a) for a in addrs)


class DistributedChain:
    def __init__(
        self,
        access: SwarmAccess,
        settings: ChainSettings,
        route: Route,
        records: list[NodeRecord],
        need_tokens: int,
        false_reports: FalseReports | None = None,
        kept: KeptConversations | None = None,
        resume: Resume | None = None,
        room: RoomQueue | None = None,
        room_deadline: float = 0.0,
        room_wait_s: float = 0.0,
        client_gone: Callable[[], bool] = lambda: False,
        slot: SessionSlot | None = None,
        refuse_if_full: Callable[[], None] = lambda: None,
    ) -> None:
        """`false_reports`: the node's ledger of reports that proved false (shared by its
        requests, so a repeat offender is caught; a fresh one when not given); `kept`:
        the node's ledger of conversations its routes keep (None: the stages keep
        nothing); `resume`: the kept conversation this request continues, on `route`;
        `room`: where the request waits when every holder of some layers is busy (None:
        those are left out, as stages that declined): until `room_deadline`
        (time.monotonic) before its first step, for `room_wait_s` at a time after it, or
        until `client_gone` says its client left; `slot`: the request's coordinator
        session slot, given back for such a wait (and taken again after it);
        `refuse_if_full`: raises QueueFullError when the node's queue is full, asked
        before a request that has not started joins a line (a started one always may)."""
        self._access = access
        self._false_reports = false_reports if false_reports is not None else FalseReports()
        self._settings = settings
        self.route = route
        self._records = records  # the holders the route was planned from (their addresses)
        self.hops = _hops(route, records)
        self.failovers = 0
        self._need_tokens = need_tokens
        self._ring: Ring | None = None
        self._session_id = ""
        self._max_length = 0
        self._sampling: SamplingParams | None = None
        # Every step the ring has taken, as it was sent: a failover replays them one by one.
        self._steps: list[list[int]] = []
        self._reply: list[int] = []  # tokens sampled so far
        self._excluded: set[str] = set()  # left out of this request (not banned)
        self._stage_s: list[float] = [0.0] * len(route.stages)
        self._activation_bytes = 0
        self._attempt = 0
        self._vouched = False  # this ring's peers are in the ledger as having served
        # The route's remote stages' RTTs as this ring was built (`_measure` reads them
        # every decode step; the peer table's whole snapshot is not for a hot path).
        self._link_ms = self._route_rtts()
        self._kept = kept
        self._resume = resume  # tried on the first ring only
        self._reused = 0
        self._prompt_length = 0
        self._room = room
        self._room_deadline = room_deadline
        self._declined: set[str] = set()  # had no room for this request at its last try
        self._room_wait_s = room_wait_s
        self._ticket: Ticket | None = None  # its place in line while stages are busy
        self._waiting_since = 0.0
        self._wait_until = 0.0
        self.room_waits = 0  # times this request waited for a busy stage
        self._client_gone = client_gone
        self._slot = slot
        self._refuse_if_full = refuse_if_full

    @property
    def is_local(self) -> bool:
        return False

    async def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams,
        prompt: list[int],
        share: str | None = None,
    ) -> int:
        # `share` is a one-node route's: stages of a ring hold no copyable caches (yet).
        self._session_id, self._max_length, self._sampling = session_id, max_length, sampling
        self._prompt_length = len(prompt)
        await self._run([], False, _go_on)
        return self._reused  # positions of a kept conversation every stage took over

    async def step(self, token_ids: list[int], want_token: bool) -> Sampled | None:
        return await self._run([token_ids], want_token, _go_on)

    async def prefill(self, chunks: list[list[int]], before_each: Callable[[], None]) -> Sampled:
        """The prompt's chunks, pipelined: up to one chunk per stage in flight, and one more."""
        token = await self._run(chunks, True, before_each)
        if token is None:
            raise InternalError("prefill produced no token")
        return token

    async def close(self) -> None:
        """End the session; its stages keep their caches, and this node remembers what
        they hold, for the conversation's next turn."""
        ring = self._ring
        try:
            await self._drop_ring()
        finally:
            self._leave_room()  # its place in line goes whatever happens
        if ring is not None and self._kept is not None and self._keeps(self.route):
            self._kept.remember(
                self._settings.model_id, self.route, ring.sid, self._steps, self._prompt_length
            )
        if ring is not None and self._room is not None:
            self._room.freed()  # its stages free what it held: the waiters try

    def _leave_room(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None and self._room is not None:
            self._room.leave(ticket)

    async def _drop_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            await self._access.in_trio(ring.close)

    def _keeps(self, route: Route) -> bool:
        """Whether this route's stages are asked to keep the session's caches: all of them
        read `keep` (an older stage would take the frame for garbage)."""
        if self._kept is None:
            return False
        versions = {r.peer_id: r.version for r in self._records}
        return all(wire.reads_resume(versions.get(p, "0")) for p in route.peers)

    def stage_seconds(self) -> list[float]:
        return list(self._stage_s)

    def activation_bytes(self) -> int:
        return self._activation_bytes

    # --- the failover loop ---------------------------------------------------------------

    def _window(self) -> int:
        """Steps in flight on the ring: one per stage keeps every stage busy, and one
        more covers the links' round trip (the next chunk is on its way to stage 0 while
        the last stage's answer travels back; measured over 40 ms links, one per stage
        alone left stage 0 idle for a round trip per chunk)."""
        return len(self.route.stages) + 1

    async def _run(
        self, steps: list[list[int]], want_last: bool, before_each: Callable[[], None]
    ) -> Sampled | None:
        """Feed `steps` on the ring (built first if need be), failing over as often as
        allowed; the token the last one drew when `want_last`. A failover resumes with the
        first step the lost ring did not answer."""
        done = 0
        drawn: Sampled | None = None
        ring: Ring | None = None

        # `replied` and `before_each` run in the trio thread (inside `ring.steps`) while
        # this task waits for it: what they write is the chain's own or locked (the peer
        # table, the false-report ledger), and `before_each` only reads.
        def replied(reply: wire.TokenReply) -> None:
            nonlocal done, drawn
            self._account(reply)
            if len(steps[done]) == 1 and ring is not None:
                self._measure(reply, ring.round_trip_s)
            if not self._vouched:  # every peer of the ring carried this step
                self._false_reports.served(self.route.peers)
                self._vouched = True
            self._steps.append(list(steps[done]))
            done += 1
            if reply.token is not None:
                self._reply.append(reply.token)
                drawn = Sampled(reply.token, reply.logprobs)

        while True:
            try:
                if self._ring is None:
                    if self._attempt == 0:
                        await self._queue_behind_others()
                    await self._build_ring()
                    self._leave_room()  # the ring is open: it no longer waits in line
                ring = self._ring
                if ring is None:
                    raise InternalError("no ring")
                last = len(steps) - 1
                todo = [(ids, want_last and i == last, False) for i, ids in enumerate(steps)]
                window = self._window()
                await self._access.in_trio(ring.steps, todo[done:], window, before_each, replied)
                return drawn
            except (StageFailedError, BaseExceptionGroup) as caught:
                exc = first_of(caught, StageFailedError)
                if exc is None:
                    raise
                await self._fail_over(exc)

    def _route_rtts(self) -> dict[str, float]:
        rtt = self._access.rtt_ms()
        return {peer: rtt[peer] for peer in self.route.peers if peer in rtt}

    def _measure(self, reply: wire.TokenReply, round_trip_s: float) -> None:
        """Each remote stage's ms per layer in a one-token step, for route planning.

        The step's round trip, which this node timed itself, is what the planner must
        predict: each stage's reported compute (capped by that round trip), plus the
        time no report and no link explains (the round trip less every stage's compute
        and the remote stages' measured RTTs), shared among the remote stages by their
        layers. So a stage slow outside its compute (an overloaded host, a slow link) is
        charged for it, and one that under-reports its compute gains nothing: in a route
        of one remote stage the whole round trip lands on it.
        """
        total_ms = round_trip_s * 1000.0
        stages = list(zip(self.route.stages, reply.stage_ms, strict=False))
        remote = [(stage, min(ms, total_ms)) for stage, ms in stages if not stage.local]
        if not remote:
            return
        rtt = self._link_ms
        explained = sum(min(ms, total_ms) for _, ms in stages)
        explained += sum(rtt.get(stage.peer_id, 0.0) for stage, _ in remote)
        unexplained = max(0.0, total_ms - explained)
        layers = sum(stage.layers.size for stage, _ in remote)
        for stage, ms in remote:
            share = unexplained * stage.layers.size / layers
            self._access.measured(stage.peer_id, (ms + share) / stage.layers.size)

    def _account(self, reply: wire.TokenReply) -> None:
        for i, stage_ms in enumerate(reply.stage_ms[: len(self._stage_s)]):
            self._stage_s[i] += stage_ms / 1000.0
        self._activation_bytes += reply.activation_bytes

    async def _build_ring(self) -> None:
        """Open a ring on the current route and replay what the last one had been fed."""
        if self._sampling is None:
            raise InternalError("open() first")
        self._attempt += 1
        resume, self._resume = self._resume, None  # a failover's ring replays instead
        keep = self._keeps(self.route)
        request = open_request(
            f"{self._session_id}.{self._attempt}",
            self.route,
            self._records,
            self._access.peer_id,
            tuple(self._access.listen_addrs()),
            self._settings,
            self._max_length,
            self._sampling,
            tuple(self._reply),
            keep,
            (resume.sid, resume.length) if resume is not None and keep else None,
            resume is not None and resume.copy,
        )
        ring = Ring(
            self._access.stage_service, request, self._settings.timeouts, self._settings.vocab_size
        )
        self._ring = ring
        self._vouched = False
        self._link_ms = self._route_rtts()
        await self._access.in_trio(ring.open)
        if request.resume is not None and resume is not None:
            if ring.reused == resume.length:
                self._steps = resume.steps  # what the caches hold: a failover replays them
                self._reused = resume.length
                return
            # A stage let the conversation go: a fresh session, and the whole prompt.
            if self._kept is not None:
                self._kept.forget(resume.sid)  # (taken already, unless it was a copy)
            log.info(
                "resume of %s missed on the route (%d of %d positions): prefilling",
                resume.sid,
                ring.reused,
                resume.length,
            )
            await self._drop_ring()
            await self._build_ring()
            return
        chunk = min(self._settings.chunk_tokens, bounds.MAX_STEP_TOKENS)
        replay = [(ids, False, alone) for ids, alone in replay_steps(self._steps, chunk)]
        if replay:
            await self._access.in_trio(ring.steps, replay, self._window(), _go_on, self._account)

    async def _fail_over(self, exc: StageFailedError) -> None:
        await self._drop_ring()
        if exc.kind == "busy" and self._room is not None:
            await self._find_room(exc)
            return
        self.failovers += 1
        peer = exc.peer_id
        log.warning(
            "DIAG: stage failed request_id=%s peer=%s kind=%s failover=%d: %s",
            self._session_id,
            peer[-8:] if peer else "?",
            exc.kind,
            self.failovers,
            exc,
        )
        if self.failovers > self._settings.max_failovers:
            raise RouteFailedError(
                f"The route failed {self.failovers} times (limit {self._settings.max_failovers});"
                f" last: {exc}"
            ) from exc
        if peer == self._access.peer_id:
            peer = None  # a link to this node failed: the route is retried, nobody banned
        if not await self._blame(exc, peer):
            peer = None  # nobody's stage to replace: the route is planned afresh
        await self._refresh_holders()
        try:
            route = self._replan_through_busy(peer)
        except NoRouteError:
            if await self._lost_ones_back(peer):
                self._take_route(self._replan_through_busy(peer))
                return
            if self._declined and self._room is not None:
                # The holders left are those that were busy at an earlier try: busy is no
                # failure, so they are asked again, and one still full says "busy" and
                # the request waits its turn (`_find_room`), as README's failover promises.
                self._declined.clear()
                self._take_route(self._replan_through_busy(peer))
                return
            if not isinstance(exc, UnconfirmedReportError) or peer is None:
                raise
            # Only the named peer holds its range: one of the two is at fault, so this
            # request avoids the teller instead.
            self._excluded.discard(peer)
            self._excluded.add(exc.reporter)
            route = self._replan(exc.reporter)
        self._take_route(route)

    async def _lost_ones_back(self, replaced: str | None) -> bool:
        """Holders that sit out after an earlier loss (not `replaced`, just lost), asked
        when no route does without them: True when one answered and is back."""
        out = self._access.sitting_out() - self._access.banned() - self._excluded
        out -= self._declined | {replaced}
        return bool(await _asked_back(self._access, self._records, out))

    async def _refresh_holders(self) -> None:
        sent = self._sampling or SamplingParams()  # before open(): nothing new to read
        self._records = await holders_for(self._access, self._settings.model_id, sent)

    def _take_route(self, route: Route) -> None:
        """Go on with `route` (planned from `_records`)."""
        old, self.route = self.route, route
        self.hops = _hops(route, self._records)
        self._stage_s = _carry_over(old, route, self._stage_s)

    async def _queue_behind_others(self) -> None:
        """A new request for a model whose busy stages others already wait for takes its
        place behind them and tries when its turn comes, rather than at once: else it
        could take the room a session's end frees before the requests waiting for it
        (each time), and they would wait until their deadlines."""
        if self._room is None or self._ticket is not None:
            return
        key = self._room.line_of(self._settings.model_id)
        if key is None:
            return
        self._refuse_if_full()
        self._ticket = self._room.join(key)
        self._waiting_since = time.monotonic()
        self._wait_until = self._room_deadline
        await self._wait_in_line(list(key[1]), None)
        if self._resume is not None:
            return  # a kept conversation stays on the route that holds its caches
        # The holders may have changed while it waited: the route is planned again.
        await self._refresh_holders()
        self._take_route(self._replan_through_busy(None))

    async def _wait_in_line(
        self, missing: list[tuple[int, int]], exc: StageFailedError | None
    ) -> None:
        """Wait for this request's turn in its line (its ticket), without its session
        slot: RouteBusyError at the deadline."""
        assert self._room is not None and self._ticket is not None
        self.room_waits += 1
        # Its session slot is free for others while it waits; taken again (in turn,
        # within the same deadline) only when it is to try again.
        if self._slot is not None:
            self._slot.give()
        if not await self._room.wait(self._ticket, self._wait_until, self._client_gone):
            self._leave_room()
            waited = time.monotonic() - self._waiting_since
            model = self._settings.model_id
            raise RouteBusyError(model, missing, self._need_tokens, waited) from exc
        if self._slot is not None:
            await self._slot.take(self._wait_until)

    async def _find_room(self, exc: StageFailedError) -> None:
        """A stage had no room for this request now (no failure: nobody is blamed, and it
        is no failover): another holder of its range with room, else wait in line until
        the busy holders may have some, and try them again. Each call checks the deadline,
        so a stage that keeps saying "busy" costs a wait per try, never a loop."""
        log.info(
            "stage declined request_id=%s peer=%s: %s",
            self._session_id,
            exc.peer_id[-8:] if exc.peer_id else "this node",
            exc,
        )
        assert self._room is not None
        now = time.monotonic()
        if self._ticket is None:  # a new wait: before the first step, within admission's
            self._waiting_since = now
            self._wait_until = self._room_deadline if not self._steps else now + self._room_wait_s
        peer = exc.peer_id
        await self._refresh_holders()
        route: Route | None = None
        missing: list[tuple[int, int]] = []
        if peer is not None:
            self._declined.add(peer)
            try:
                route = self._replan(peer)  # the busy range elsewhere, with room
            except NoRouteError as busy:
                missing = busy.missing
        if route is None:
            if self._ticket is None:
                if not self._steps:
                    self._refuse_if_full()
                self._ticket = self._room.join((self._settings.model_id, tuple(missing)))
            await self._wait_in_line(missing, exc)
            self._declined.clear()
            await self._refresh_holders()
            route = self._replan_through_busy(None)  # one whose record shows room first
        self._take_route(route)

    def _replan_through_busy(self, peer: str | None) -> Route:
        """`_replan`, and when every other holder of a range announces no room, through
        those whose budget could take the request anyway (with a `RoomQueue`): a record's
        free tokens lag, and a stage really full says "busy", which is waited out."""
        try:
            return self._replan(peer)
        except NoRouteError:
            if self._room is None:
                raise
            return self._replan(peer, ignore_room=True)

    def _replan(self, peer: str | None, ignore_room: bool = False) -> Route:
        """The route with `peer`'s stage replaced (None: planned afresh), avoiding every
        banned or left-out peer, and those that had no room at the last try."""
        banned = self._access.banned() | self._access.sitting_out()
        banned |= self._excluded | self._declined
        records, need = self._records, self._need_tokens
        if ignore_room:
            records, need = [r for r in records if r.kv_budget_tokens >= need], 0
        if peer is not None and peer in self.route.peers:
            return replan(
                self.route,
                peer,
                records,
                rtt_ms=self._access.rtt_ms(),
                layer_ms=self._access.layer_ms(),
                banned=banned,
                need_tokens=need,
            )
        return plan_route(  # nobody to blame: a fresh route (maybe the same peers)
            self.route.model_id,
            self.route.num_layers,
            self._access.peer_id,
            records,
            rtt_ms=self._access.rtt_ms(),
            layer_ms=self._access.layer_ms(),
            banned=banned,
            need_tokens=need,
        )

    async def _blame(self, exc: StageFailedError, peer: str | None) -> bool:
        """Ban, leave out or charge, as `exc` warrants; True when `peer`'s stage is the
        one to replace (False: nobody named, or a report's teller banned instead)."""
        if isinstance(exc, UnconfirmedReportError):
            # Another peer's word, and the peer it named answered our check: that peer is
            # avoided for this request; a teller whose reports keep proving false is banned.
            # A report of a peer on the route is about the teller's own link, which a ping
            # cannot disprove: a teller that has served sessions is not charged for it.
            about_route = exc.peer_id is not None
            vouched = about_route and self._false_reports.vouched(exc.reporter)
            if exc.disproved and not vouched and self._false_reports.add(exc.reporter):
                n, window = self._false_reports.limit, self._false_reports.window_s
                why = f"{n} failure reports in {window:g} s proved false"
                await self._access.ban(exc.reporter, why)
                return False  # and its word about the named peer is dismissed
            if peer is not None:
                self._excluded.add(peer)
        elif peer is not None and exc.kind in ("declined", "busy"):
            self._excluded.add(peer)
        elif peer is not None and exc.kind == "lost":  # silent or gone: nothing it sent
            await self._access.lose(peer, f"stage failed (lost): {exc}")
        elif peer is not None:
            await self._access.ban(peer, f"stage failed ({exc.kind}): {exc}")
        return peer is not None


def _go_on() -> None:
    """Nothing to check before a step (`DistributedChain._run`)."""


def replay_steps(steps: list[list[int]], chunk: int) -> list[tuple[list[int], bool]]:
    """How a failover feeds a new route what the lost one took, so that every stage
    recomputes bit for bit what the lost route computed: each step of several tokens (a
    prompt chunk) as it was, and each run of one-token steps (the reply) in chunks of
    `chunk` marked `alone`. A stage since 0.5 gives a position the same bits in any chunk,
    so for it the cut does not matter; one before 0.5 rounds a chunk's attention otherwise
    than one-token steps unless the chunk is marked `alone`.
    """
    out: list[tuple[list[int], bool]] = []
    run: list[int] = []
    for step in [*steps, []]:  # the empty step ends the last run
        if len(step) == 1:
            run.append(step[0])
            if len(run) == chunk:
                out.append((run, True))
                run = []
            continue
        if run:
            out.append((run, len(run) > 1))
            run = []
        if step:
            out.append((step, False))
    return out


def open_request(
    sid: str,
    route: Route,
    records: list[NodeRecord],
    me: str,
    my_addrs: tuple[str, ...],
    settings: ChainSettings,
    max_length: int,
    sampling: SamplingParams,
    history: tuple[int, ...],
    keep: bool = False,
    resume: tuple[str, int] | None = None,
    copy: bool = False,
) -> wire.OpenRequest:
    """The `open` frame's request for stage 0 of `route` (pure). `top_k` travels as the
    wire reads it (`bounds.wire_top_k`: off at or over the vocabulary); `keep`, `resume`
    and `copy`: see `wire` (prefix reuse)."""
    by_peer = {r.peer_id: r for r in records}
    addrs = {p: by_peer[p].addrs for p in route.peers if p in by_peer}
    addrs[me] = my_addrs
    return wire.OpenRequest(
        sid=sid,
        hop=0,
        route=tuple(wire.RouteHop(s.peer_id, s.start, s.end) for s in route.stages),
        addrs={p: _dialable(p, v) for p, v in addrs.items()},
        coordinator=me,
        model_id=settings.model_id,
        max_length=max_length,
        sampling=replace(sampling, top_k=bounds.wire_top_k(sampling.top_k, settings.vocab_size)),
        history=history,
        keep=keep,
        resume=resume,
        copy=copy and resume is not None,
    )


def _dialable(peer_id: str, addrs: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    ok = [a for a in addrs if wire.is_dialable(peer_id, a)]
    return tuple(ok[: wire.MAX_ADDRS_PER_PEER])


def _carry_over(old: Route, new: Route, seconds: list[float]) -> list[float]:
    """Per-stage seconds kept for the stages the new route still has (same peer, range)."""
    kept = {(s.peer_id, s.start, s.end): t for s, t in zip(old.stages, seconds, strict=False)}
    return [kept.get((s.peer_id, s.start, s.end), 0.0) for s in new.stages]
