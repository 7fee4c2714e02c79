"""`Coordinator`: admits a request, picks its route, runs it, and reports it.

The node that receives an API request coordinates it, for any model of the swarm. A
node holding the whole model answers locally (`LocalChain`); otherwise it plans a route
over the swarm's holders and runs a `DistributedChain` (with failover) on it. For a model
it holds no layers of, it first takes the model's common files (`CommonModel`, through
the node's `ModelFinder`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeAlias

from swarmd.errors import ModelNotFoundError, QueueFullError, SwarmError
from swarmd.model.common import CommonModel
from swarmd.model.sampling import SamplingParams
from swarmd.pipeline.admission import KVBudget, SessionSlot, SessionSlots, unless_gone
from swarmd.pipeline.chain import Hop, StageChain, route_kind
from swarmd.pipeline.distributed import (
    ChainSettings,
    DistributedChain,
    SwarmAccess,
    holders_for,
    plan,
    route_capacity,
)
from swarmd.pipeline.generation import Generation, GenerationRequest, Timing
from swarmd.pipeline.kept import KeptConversations
from swarmd.pipeline.report import FalseReports, RequestRecord, RequestRing, ms
from swarmd.pipeline.room import RoomQueue

if TYPE_CHECKING:  # a node holding no layers never imports torch
    from swarmd.model.loader import LoadedModel

log = logging.getLogger("swarmd.requests")

Routed: TypeAlias = "LoadedModel | CommonModel"  # a model held here, or one coordinated


class Held(Protocol):
    """A model this node holds layers of (`swarmd.held.HeldModel`)."""

    @property
    def model(self) -> LoadedModel: ...

    @property
    def kv_budget(self) -> KVBudget:
        """This node's KV tokens for the model; a local session reserves its tokens here."""
        ...

    def local_chain(self, hop: Hop, step_timeout_s: float) -> StageChain:
        """A route of one hop on this node's worker (the model held whole)."""
        ...


class ModelFinder(Protocol):
    async def common_model(self, model_id: str) -> CommonModel:
        """A model of the swarm this node holds no layers of, ready to coordinate;
        ModelNotFoundError when no holder serves it in a way this node can route."""
        ...


@dataclass(frozen=True)
class CoordinatorLimits:
    max_sessions: int  # generations in flight on this node
    queue_timeout_s: float  # longest wait for a free slot
    step_timeout_s: float  # longest single model step
    prefill_chunk_tokens: int
    max_queued_requests: int = 256  # requests waiting for a slot or KV room; more get 503


class Coordinator:
    def __init__(
        self,
        held: Mapping[str, Held],
        short_id: str,
        limits: CoordinatorLimits,
        swarm: SwarmAccess,
        chain_settings: ChainSettings,
        finder: ModelFinder | None = None,
    ) -> None:
        """`held`: the models this node holds layers of, by id (none: it only
        coordinates); `chain_settings`: the ring's settings, whatever the model (its id
        and sizes are each request's); `finder`: the models of the swarm this node holds
        no layers of (None: only its own are served)."""
        self.held = held
        self._finder = finder
        self._routed: dict[str, CommonModel] = {}  # the other models, once resolved
        self.swarm = swarm
        self.chain_settings = chain_settings
        self.short_id = short_id
        self.ring = RequestRing()
        # Failure reports of other stages that this node's checks disproved, per teller:
        # shared by every request, so a peer that keeps naming honest ones is banned.
        self.false_reports = FalseReports()
        # What this node's finished distributed sessions left in their stages' caches.
        self.kept = KeptConversations()
        # Told of every finished request, with the gaps between its tokens (metrics).
        self.observe: Callable[[RequestRecord, list[float]], None] | None = None
        self._limits = limits
        self._slots = SessionSlots(limits.max_sessions, limits.queue_timeout_s)
        self._queued = 0  # requests queued for a slot or for KV room
        # Distributed requests whose stages are all busy wait here, woken as sessions end.
        self.room = RoomQueue()

    @property
    def in_flight(self) -> int:
        """Requests this node coordinates that hold a session slot."""
        return self._slots.in_flight

    @property
    def waiting(self) -> int:
        """Requests queued: for a session slot, for KV room, or for a busy stage."""
        return self._queued + self.room.waiting

    @contextmanager
    def _in_line(self) -> Iterator[None]:
        """A request waiting for a slot or KV room, counted in `waiting`; QueueFullError
        (503) when `max_queued_requests` wait already. Checked here, where a request
        would wait, not only as it arrives: a burst arrives all at once, before any of
        it waits (found by a stress run: 12 at once all queued past a cap of 4)."""
        self._refuse_if_full()
        self._queued += 1
        try:
            yield
        finally:
            self._queued -= 1

    def _refuse_if_full(self) -> None:
        """QueueFullError when a request that would wait finds `max_queued_requests`
        waiting already (for a slot, KV room, or a busy stage)."""
        if self.waiting >= self._limits.max_queued_requests:
            raise QueueFullError(self.waiting)

    def recent_tokens_per_second(self, model_id: str | None = None) -> float:
        """Median decode speed of the recent requests (of `model_id`; 0.0 before any)."""
        speeds = sorted(
            r.tok_per_sec
            for r in self.ring.recent()
            if r.tok_per_sec and (model_id is None or r.model == model_id)
        )
        return speeds[len(speeds) // 2] if speeds else 0.0

    async def resolve(self, model_id: str) -> Routed:
        """The model a request names: one this node holds, or another of the swarm."""
        held = self.held.get(model_id)
        if held is not None:
            return held.model
        if self._finder is None:
            raise ModelNotFoundError(model_id, list(self.held))
        model = await self._finder.common_model(model_id)
        self._routed[model_id] = model
        return model

    def routed(self, model_id: str) -> Routed:
        """A model `resolve` has answered for."""
        held = self.held.get(model_id)
        if held is not None:
            return held.model
        model = self._routed.get(model_id)
        if model is None:
            raise ModelNotFoundError(model_id, list(self.held))
        return model

    def local_budget(self, model_id: str) -> KVBudget | None:
        """This node's KV budget for a model it holds whole (None: it routes it)."""
        held = self.held.get(model_id)
        return held.kv_budget if held is not None and held.model.is_whole else None

    async def session_room(self, model: Routed, sampling: SamplingParams) -> int | None:
        """The most KV tokens one session of `model` can hold: this node's budget when it
        holds the model whole, else what the best route over its holders could (None: a
        layer has no holder, which planning reports)."""
        budget = self.local_budget(model.model_id)
        if budget is not None:
            return budget.total
        records = await holders_for(self.swarm, model.model_id, sampling)
        return route_capacity(records, model.num_layers, self.swarm.banned())

    def settings_for(self, model: Routed) -> ChainSettings:
        return replace(
            self.chain_settings,
            model_id=model.model_id,
            num_layers=model.num_layers,
            vocab_size=model.vocab_size,
        )

    async def plan(
        self,
        need_tokens: int,
        sampling: SamplingParams,
        model: Routed,
        prompt: list[int],
        deadline: float = 0.0,
        client_gone: Callable[[], bool] = lambda: False,
        slot: SessionSlot | None = None,
    ) -> StageChain:
        """This node alone when it holds every layer, else the best route over the swarm:
        the route of the conversation `prompt` continues, while it serves (its stages
        hold that conversation's caches). `deadline` (time.monotonic): how long a
        distributed request may wait for a busy stage."""
        held = self.held.get(model.model_id)
        if held is not None and held.model.is_whole:
            hop = Hop(self.short_id, held.model.layers)
            return held.local_chain(hop, self._limits.step_timeout_s)
        settings = self.settings_for(model)
        route, records = await plan(self.swarm, settings, need_tokens, sampling)
        avoid = self.swarm.banned() | self.swarm.sitting_out()
        taken = self.kept.take(model.model_id, prompt, records, avoid, route)
        resume = None
        if taken is not None:
            route, resume = taken
        return DistributedChain(
            self.swarm,
            settings,
            route,
            records,
            need_tokens,
            self.false_reports,
            self.kept,
            resume,
            self.room,
            deadline,
            self._limits.queue_timeout_s,
            client_gone,
            slot,
            self._refuse_if_full,
        )

    @asynccontextmanager
    async def generation(
        self,
        request: GenerationRequest,
        timing: Timing,
        client_gone: Callable[[], bool] = lambda: False,
        on_prefilled: Callable[[], None] | None = None,
    ) -> AsyncIterator[Generation]:
        """Admit, route and run one request; log its DIAG line however it ends.
        `on_prefilled`: told when the prompt is in the caches (see `Generation`)."""
        gen: Generation | None = None
        error: BaseException | None = None
        slot = self._slots.slot(client_gone)
        reserved = 0
        need = len(request.prompt_ids) + request.max_tokens
        model = self.routed(request.model_id)
        budget = self.local_budget(request.model_id)
        try:
            deadline = time.monotonic() + self._limits.queue_timeout_s

            async def reserve() -> None:
                nonlocal reserved
                assert budget is not None
                await budget.reserve(need, self._limits.queue_timeout_s)
                reserved = need  # here, not after the wait: see `unless_gone`

            # FIFO for KV room: the whole session's tokens from now to its end.
            if budget is not None and budget.try_reserve(need):
                reserved = need
            elif budget is not None:
                # One that could never fit is told so (413) at once, full queue or not.
                fits = need <= budget.total
                with self._in_line() if fits else nullcontext():
                    await unless_gone(reserve(), client_gone)
            with self._in_line() if slot.would_wait() else nullcontext():
                await slot.take(deadline)
            timing.queue_s = timing.since_received()
            sched_started = time.perf_counter()
            chain = await self.plan(
                need, request.sampling, model, request.prompt_ids, deadline, client_gone, slot
            )
            timing.sched_s = time.perf_counter() - sched_started
            gen = Generation(
                request,
                chain,
                model.codec,
                self._limits.prefill_chunk_tokens,
                timing,
                client_gone,
                on_prefilled,
            )
            yield gen
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                if gen is not None:
                    # Free the KV cache even when the handler is being cancelled, once
                    # no step of this generation runs any more.
                    await asyncio.shield(_settle_and_close(gen))
            except SwarmError as exc:
                log.warning("DIAG: session close failed request_id=%s: %s", request.request_id, exc)
            finally:
                slot.give()
                if budget is not None and reserved:
                    budget.release(reserved)
                timing.total_s = timing.since_received()
                self.report(self._record(request, timing, gen, error), timing.token_gaps_s)

    def report(self, record: RequestRecord, token_gaps_s: list[float] | None = None) -> None:
        self.ring.add(record)
        if record.outcome == "ok":
            log.info(record.diag_line())
        else:
            log.warning(record.diag_line())  # a failure: it also lands in the failure ring
        if self.observe is not None:
            self.observe(record, token_gaps_s or [])

    def _record(
        self,
        request: GenerationRequest,
        timing: Timing,
        gen: Generation | None,
        error: BaseException | None,
    ) -> RequestRecord:
        chain = gen.chain if gen is not None else None
        return RequestRecord(
            request_id=request.request_id,
            model=request.model_id,
            route=_route_kind(chain, self.local_budget(request.model_id) is not None),
            nodes=[hop.short_id for hop in chain.hops] if chain is not None else [],
            relayed=[hop.short_id for hop in chain.hops if hop.relayed] if chain else [],
            outcome="ok" if error is None else "error",
            error_type=None if error is None else type(error).__name__,
            queue_ms=ms(timing.queue_s),
            sched_ms=ms(timing.sched_s),
            ttft_ms=ms(timing.ttft_s),
            decode_ms=ms(timing.decode_s),
            total_ms=ms(timing.total_s),
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=gen.cached_tokens if gen is not None else None,
            tokens=gen.completion_tokens if gen is not None and gen.tokens else None,
            stage_ms=tuple(s * 1000.0 for s in chain.stage_seconds()) if chain else (),
            activation_bytes=chain.activation_bytes() if chain is not None else None,
            failovers=chain.failovers if chain is not None else None,
        )


def _route_kind(chain: StageChain | None, held_whole: bool) -> str:
    if chain is not None:
        return route_kind(chain)
    return "local" if held_whole else "distributed"  # refused before a route existed


async def _settle_and_close(gen: Generation) -> None:
    try:
        await gen.settle()
    finally:
        await gen.chain.close()
