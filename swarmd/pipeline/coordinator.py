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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Protocol

from swarmd.errors import ModelNotFoundError, OverloadedError, SwarmError
from swarmd.model.common import CommonModel
from swarmd.model.loader import LoadedModel
from swarmd.model.sampling import SamplingParams
from swarmd.model.worker import TorchWorker
from swarmd.pipeline.admission import KVBudget
from swarmd.pipeline.chain import Hop, LocalChain, StageChain
from swarmd.pipeline.distributed import ChainSettings, DistributedChain, SwarmAccess, plan
from swarmd.pipeline.generation import Generation, GenerationRequest, Timing
from swarmd.pipeline.report import FalseReports, RequestRecord, RequestRing, ms

log = logging.getLogger("swarmd.requests")

Routed = LoadedModel | CommonModel  # a model this node serves, or one it coordinates


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


class Coordinator:
    def __init__(
        self,
        model: LoadedModel,
        worker: TorchWorker,
        short_id: str,
        limits: CoordinatorLimits,
        swarm: SwarmAccess,
        chain_settings: ChainSettings,
        kv_budget: KVBudget,
        finder: ModelFinder | None = None,
    ) -> None:
        """`finder`: the models of the swarm this node holds no layers of (None: only its
        own model is served)."""
        self.model = model
        self._finder = finder
        self._routed: dict[str, CommonModel] = {}  # the other models, once resolved
        self.swarm = swarm
        self.chain_settings = chain_settings
        self.short_id = short_id
        self.ring = RequestRing()
        # Failure reports of other stages that this node's checks disproved, per teller:
        # shared by every request, so a peer that keeps naming honest ones is banned.
        self.false_reports = FalseReports()
        # Told of every finished request, with the gaps between its tokens (metrics).
        self.observe: Callable[[RequestRecord, list[float]], None] | None = None
        self.in_flight = 0
        self._worker = worker
        self._limits = limits
        self._slots = asyncio.Semaphore(limits.max_sessions)
        self.kv_budget = kv_budget  # this node's; a local session reserves its tokens here
        self.waiting = 0  # requests queued for a slot or for KV room

    def recent_tokens_per_second(self) -> float:
        """Median decode speed of the recent requests (0.0 before any)."""
        speeds = sorted(r.tok_per_sec for r in self.ring.recent() if r.tok_per_sec)
        return speeds[len(speeds) // 2] if speeds else 0.0

    async def resolve(self, model_id: str) -> Routed:
        """The model a request names: this node's own, or another of the swarm."""
        if model_id == self.model.model_id:
            return self.model
        if self._finder is None:
            raise ModelNotFoundError(model_id, [self.model.model_id])
        model = await self._finder.common_model(model_id)
        self._routed[model_id] = model
        return model

    def routed(self, model_id: str) -> Routed:
        """A model `resolve` has answered for."""
        if model_id == self.model.model_id:
            return self.model
        model = self._routed.get(model_id)
        if model is None:
            raise ModelNotFoundError(model_id, [self.model.model_id])
        return model

    def settings_for(self, model: Routed) -> ChainSettings:
        if model is self.model:
            return self.chain_settings
        return replace(
            self.chain_settings,
            model_id=model.model_id,
            num_layers=model.num_layers,
            vocab_size=model.vocab_size,
        )

    async def plan(self, need_tokens: int, sampling: SamplingParams, model: Routed) -> StageChain:
        """This node alone when it holds every layer, else the best route over the swarm."""
        if isinstance(model, LoadedModel) and model.is_whole:
            hop = Hop(self.short_id, model.layers)
            return LocalChain(self._worker, hop, self._limits.step_timeout_s)
        settings = self.settings_for(model)
        route, records = await plan(self.swarm, settings, need_tokens, sampling)
        return DistributedChain(
            self.swarm, settings, route, records, need_tokens, self.false_reports
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
        acquired = False
        reserved = 0
        need = len(request.prompt_ids) + request.max_tokens
        model = self.routed(request.model_id)
        try:
            deadline = time.monotonic() + self._limits.queue_timeout_s
            self.waiting += 1
            try:
                if model.is_whole:
                    # FIFO for KV room: the whole session's tokens from now to its end.
                    await self.kv_budget.reserve(need, self._limits.queue_timeout_s)
                    reserved = need
                await asyncio.wait_for(
                    self._slots.acquire(), max(0.01, deadline - time.monotonic())
                )
            except TimeoutError as exc:
                raise OverloadedError(
                    f"All {self._limits.max_sessions} session slots stayed busy for "
                    f"{self._limits.queue_timeout_s:g} s"
                ) from exc
            finally:
                self.waiting -= 1
            acquired = True
            self.in_flight += 1
            timing.queue_s = timing.since_received()
            sched_started = time.perf_counter()
            chain = await self.plan(need, request.sampling, model)
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
                    # Free the KV cache even when the handler is being cancelled.
                    await asyncio.shield(gen.chain.close())
            except SwarmError as exc:
                log.warning("DIAG: session close failed request_id=%s: %s", request.request_id, exc)
            finally:
                if acquired:
                    self.in_flight -= 1
                    self._slots.release()
                if reserved:
                    self.kv_budget.release(reserved)
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
            route=_route_kind(chain, self._routed.get(request.model_id, self.model)),
            nodes=[hop.short_id for hop in chain.hops] if chain is not None else [],
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


def _route_kind(chain: StageChain | None, model: Routed) -> str:
    if chain is not None:
        return "local" if chain.is_local else "distributed"
    return "local" if model.is_whole else "distributed"  # refused before a route existed
