"""`DistributedChain`: a route over several peers, with failover (asyncio side).

It is the `StageChain` of a distributed request. Each session runs on a `Ring` (trio,
reached through the bridge). When a stage fails, the failover is the small algorithm of
STYLE habit 8:

1. ban the peer to blame (with the peer table's growing backoff; a stage that merely
   refused is only left out of this request);
2. re-route only the broken range (`route.replan`: its standby, else any other holder);
3. rebuild the session on the new route by replaying every step fed so far, as it was
   fed (the prompt's chunks, then each reply token; the last stage's sampler is told the
   reply tokens so penalties stay right), then retry the step that failed.

At most `max_failovers` times per request; then `RouteFailedError`. When nobody holds a
range any more, `NoRouteError` names the missing layers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from swarmd.dht.records import NodeRecord
from swarmd.errors import InternalError, RouteFailedError, StageFailedError
from swarmd.model.sampling import SamplingParams
from swarmd.pipeline import wire
from swarmd.pipeline.admission import needs_more_than
from swarmd.pipeline.chain import Hop
from swarmd.pipeline.ring import Ring, RingTimeouts
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

    def banned(self) -> set[str]: ...

    def listen_addrs(self) -> list[str]: ...

    async def ban(self, peer_id: str, reason: str) -> None: ...

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
    access: SwarmAccess, settings: ChainSettings, need_tokens: int
) -> tuple[Route, list[NodeRecord]]:
    """The best route for a new request and the holders' records it came from.

    NoRouteError when the holders do not cover every layer.
    """
    records = await access.holders(settings.model_id)
    holds = route_capacity(records, settings.num_layers, access.banned())
    if holds is not None and need_tokens > holds:
        raise needs_more_than(need_tokens, holds)
    route = plan_route(
        settings.model_id,
        settings.num_layers,
        access.peer_id,
        records,
        rtt_ms=access.rtt_ms(),
        banned=access.banned(),
        need_tokens=need_tokens,
    )
    return route, records


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


def _hops(route: Route) -> list[Hop]:
    return [Hop(s.peer_id[-8:], s.layers) for s in route.stages]


class DistributedChain:
    def __init__(
        self,
        access: SwarmAccess,
        settings: ChainSettings,
        route: Route,
        records: list[NodeRecord],
        need_tokens: int,
    ) -> None:
        self._access = access
        self._settings = settings
        self.route = route
        self._records = records  # the holders the route was planned from (their addresses)
        self.hops = _hops(route)
        self.failovers = 0
        self._need_tokens = need_tokens
        self._ring: Ring | None = None
        self._session_id = ""
        self._max_length = 0
        self._sampling: SamplingParams | None = None
        # Every step the ring has taken, as it was sent: a failover replays them one by one.
        self._steps: list[list[int]] = []
        self._reply: list[int] = []  # tokens sampled so far
        self._excluded: set[str] = set()  # refused this request (not banned)
        self._stage_s: list[float] = [0.0] * len(route.stages)
        self._activation_bytes = 0
        self._attempt = 0

    @property
    def is_local(self) -> bool:
        return False

    async def open(
        self, session_id: str, max_length: int, sampling: SamplingParams, prompt: list[int]
    ) -> int:
        self._session_id, self._max_length, self._sampling = session_id, max_length, sampling
        await self._with_failover(None, False)
        return 0  # prefix reuse is a one-node route's for now: every stage prefills

    async def step(self, token_ids: list[int], want_token: bool) -> int | None:
        return await self._with_failover(token_ids, want_token)

    async def close(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            await self._access.in_trio(ring.close)

    def stage_seconds(self) -> list[float]:
        return list(self._stage_s)

    def activation_bytes(self) -> int:
        return self._activation_bytes

    # --- the failover loop ---------------------------------------------------------------

    async def _with_failover(self, token_ids: list[int] | None, want: bool) -> int | None:
        while True:
            try:
                if self._ring is None:
                    await self._build_ring()
                if token_ids is None:
                    return None
                token = await self._step(token_ids, want)
                self._steps.append(list(token_ids))
                if token is not None:
                    self._reply.append(token)
                return token
            except StageFailedError as exc:
                await self._fail_over(exc)

    async def _step(self, token_ids: list[int], want: bool, alone: bool = False) -> int | None:
        ring = self._ring
        if ring is None:
            raise InternalError("no ring")
        reply = await self._access.in_trio(ring.step, token_ids, want, alone)
        for i, stage_ms in enumerate(reply.stage_ms[: len(self._stage_s)]):
            self._stage_s[i] += stage_ms / 1000.0
        self._activation_bytes += reply.activation_bytes
        return reply.token

    async def _build_ring(self) -> None:
        """Open a ring on the current route and replay what the last one had been fed."""
        if self._sampling is None:
            raise InternalError("open() first")
        self._attempt += 1
        route = self.route
        records = {r.peer_id: r for r in self._records}
        addrs = {p: records[p].addrs for p in route.peers if p in records}
        addrs[self._access.peer_id] = tuple(self._access.listen_addrs())
        request = wire.OpenRequest(
            sid=f"{self._session_id}.{self._attempt}",
            hop=0,
            route=tuple(wire.RouteHop(s.peer_id, s.start, s.end) for s in route.stages),
            addrs={p: _dialable(p, v) for p, v in addrs.items()},
            coordinator=self._access.peer_id,
            model_id=self._settings.model_id,
            max_length=self._max_length,
            sampling=self._sampling,
            history=tuple(self._reply),
        )
        ring = Ring(
            self._access.stage_service, request, self._settings.timeouts, self._settings.vocab_size
        )
        self._ring = ring
        await self._access.in_trio(ring.open)
        for tokens, alone in replay_steps(self._steps, self._settings.chunk_tokens):
            await self._step(tokens, False, alone)

    async def _fail_over(self, exc: StageFailedError) -> None:
        await self.close()
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
        if peer is not None:
            if exc.kind == "refused":
                self._excluded.add(peer)
            else:
                await self._access.ban(peer, f"stage failed ({exc.kind}): {exc}")
        records = self._records = await self._access.holders(self._settings.model_id)
        banned = self._access.banned() | self._excluded
        old = self.route
        if peer is not None and peer in old.peers:
            self.route = replan(
                old,
                peer,
                records,
                rtt_ms=self._access.rtt_ms(),
                banned=banned,
                need_tokens=self._need_tokens,
            )
        else:  # nobody to blame: try a fresh route (maybe the same peers)
            self.route = plan_route(
                old.model_id,
                old.num_layers,
                self._access.peer_id,
                records,
                rtt_ms=self._access.rtt_ms(),
                banned=banned,
                need_tokens=self._need_tokens,
            )
        self.hops = _hops(self.route)
        self._stage_s = _carry_over(old, self.route, self._stage_s)


def replay_steps(steps: list[list[int]], chunk: int) -> list[tuple[list[int], bool]]:
    """How a failover feeds a new route what the lost one took, so that every stage
    recomputes bit for bit what the lost route computed: each step of several tokens (a
    prompt chunk) as it was, and each run of one-token steps (the reply) in chunks of
    `chunk` attended `alone`, as those steps attended. One long prefill would round
    attention differently, and under bfloat16 kernels that can change a later greedy token.
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


def _dialable(peer_id: str, addrs: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    ok = [a for a in addrs if wire.is_dialable(peer_id, a)]
    return tuple(ok[: wire.MAX_ADDRS_PER_PEER])


def _carry_over(old: Route, new: Route, seconds: list[float]) -> list[float]:
    """Per-stage seconds kept for the stages the new route still has (same peer, range)."""
    kept = {(s.peer_id, s.start, s.end): t for s, t in zip(old.stages, seconds, strict=False)}
    return [kept.get((s.peer_id, s.start, s.end), 0.0) for s in new.stages]
