"""`Node`: one swarmd daemon, from start-up to a clean shutdown.

Start-up: identity -> models (per model: resolve, convert once, load its layer range;
`--no-model`: none) -> a torch worker per model -> libp2p host and DHT (trio, through the
bridge) -> join and announce (a record per model) -> API. Shutdown reverses it: the API
closes, the records are withdrawn, the host and the workers stop, and no task, thread or
socket is left behind.

A node holding no model never imports torch: what it holds is in `swarmd.held`, imported
only when there is a model to hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from swarmd import __version__
from swarmd.api.access import is_loopback_name
from swarmd.api.app import create_app
from swarmd.api.edge import Edge, EdgeLimits, listen
from swarmd.api.forward import LoopbackExecutor
from swarmd.api.metrics import NodeMetrics, NodeState
from swarmd.api.tokens import TokenStore
from swarmd.config import Config
from swarmd.dht.index import CatalogModel, ModelEntry
from swarmd.dht.records import NodeRecord
from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.errors import (
    CommonFilesError,
    ConfigError,
    FetchError,
    InternalError,
    ManifestError,
    ModelLoadError,
    ModelNotFoundError,
    ShardHashError,
    SwarmError,
)
from swarmd.model.common import CommonModel, Variant
from swarmd.model.manifest import MANIFEST_FILE, parse_manifest
from swarmd.model.memory import keep_large_blocks_returnable, release_free_heap
from swarmd.model.source import ModelSource
from swarmd.net.auth import load_swarm_key
from swarmd.net.bridge import TrioBridge
from swarmd.net.host import P2PHost
from swarmd.net.identity import Identity, load_or_create_identity
from swarmd.net.known_peers import FILE_NAME as KNOWN_PEERS_FILE
from swarmd.net.peers import BanRow, PeerRow
from swarmd.net.relay import RelaySettings
from swarmd.pipeline.coordinator import Coordinator, CoordinatorLimits
from swarmd.pipeline.distributed import ChainSettings
from swarmd.pipeline.report import FailureRing
from swarmd.pipeline.ring import RingTimeouts
from swarmd.pipeline.stage_service import StageService, StageTimeouts
from swarmd.pipeline.variants import choose_variant
from swarmd.pipeline.wire import version_tuple
from swarmd.transfer.fetch import FetchSettings
from swarmd.transfer.files import FileServers, FileServeSettings
from swarmd.transfer.forward import FORWARD_SINCE, Deliver, ForwardLimits, ForwardService, forward
from swarmd.transfer.take import fetch_folder, fetch_missing, take_manifest

if TYPE_CHECKING:  # the torch side: imported at run time only by a node holding a model
    from swarmd.held import HeldModel
    from swarmd.model.loader import LoadedModel
    from swarmd.model.runtime import StageRuntime
    from swarmd.pipeline.admission import KVBudget

log = logging.getLogger(__name__)

SWARM_START_TIMEOUT_S = 60.0  # host, DHT, bootstrap and the first announcement
MAX_COMMON_BYTES = 64 * 10**6  # tokenizer, templates, config of a model coordinated here
MODELS_CACHE_S = 2.0  # how long a catalog lookup answers /v1/models
# How long a shutdown waits for other peers' sessions here to be let go by their
# coordinators once told (a failover takes them elsewhere within a round trip or two).
LEAVE_GRACE_S = 3.0

T = TypeVar("T")


class Node:
    def __init__(
        self,
        config: Config,
        identity: Identity,
        models: Sequence[LoadedModel],
        settings: SwarmSettings | None = None,
    ) -> None:
        """`models`: the models this node holds layers of, in order (none: it only
        coordinates); `settings`: the swarm settings `prepare` already made (else made
        from config)."""
        self.config = config
        self.identity = identity
        self.tokens = TokenStore(Path(config.data_dir))
        self.edge = Edge(
            EdgeLimits(
                max_connections=config.max_connections,
                max_connections_per_client=config.max_connections_per_client,
                head_timeout_s=config.http_head_timeout_s,
            )
        )
        self.failures = FailureRing()
        self.metrics = NodeMetrics(self._metrics_state())
        self.held: dict[str, HeldModel] = {}
        self.torch_threads = 0  # none: no torch
        if models:
            from swarmd.held import HeldModel
            from swarmd.model.threads import physical_cores

            self.torch_threads = config.torch_threads or physical_cores()
            for model in models:
                self.held[model.model_id] = HeldModel(
                    config,
                    model,
                    self.torch_threads,
                    self.metrics.stage_forward.observe,
                    kv_share=1.0 / len(models),  # the measured budget, shared out
                )
        chunk_tokens = prefill_chunk(config, [h.model for h in self.held.values()])
        limits = CoordinatorLimits(
            max_sessions=config.max_sessions,
            queue_timeout_s=config.queue_timeout_s,
            step_timeout_s=config.step_timeout_s,
            prefill_chunk_tokens=chunk_tokens,
            max_queued_requests=config.max_queued_requests,
        )
        chain_settings = ChainSettings(
            model_id="",  # each request's model and sizes replace these three
            num_layers=0,
            vocab_size=0,
            chunk_tokens=chunk_tokens,
            max_failovers=config.max_failovers,
            # The ring waits a little longer than a stage's own step limit, so a slow
            # stage reports its timeout before the ring blames silence.
            timeouts=RingTimeouts(
                open_s=config.stage_open_timeout_s, step_s=config.step_timeout_s + 5.0
            ),
        )
        self.coordinator = Coordinator(
            self.held, identity.short_id, limits, self, chain_settings, finder=self
        )
        self.coordinator.observe = self.metrics.observe_request
        self.bridge = TrioBridge()
        self.swarm = SwarmPresence(
            identity,
            settings or _swarm_settings(config),
            self._make_records,
            self._run_services,
            make_index=self._make_index,
        )
        self.swarm.view.pinned.update(self.held)  # its own models' holders are always current
        self._stage_service: StageService | None = None
        self.file_servers: FileServers | None = None
        # A peer's forwarded request runs through this node's own API (api/forward.py).
        self.forwards = LoopbackExecutor(lambda: self.api_url, config.step_timeout_s + 10.0)
        self.forward_limits = ForwardLimits(max_body_bytes=config.max_body_bytes)
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        self.api_url = ""
        self._models_cache: tuple[float, list[CatalogModel]] | None = None
        # The models of the swarm this node coordinates without holding layers of them.
        self._common: dict[str, CommonModel] = {}
        self._common_locks: dict[str, asyncio.Lock] = {}
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    @classmethod
    def prepare(cls, config: Config) -> Node:
        """The blocking part of start-up: identity and model loading."""
        keep_large_blocks_returnable()
        check_api_exposure(config)  # before anything slow: a refusal comes at once
        identity = load_or_create_identity(Path(config.data_dir))
        log.info("node %s (short id %s)", identity.peer_id, identity.short_id)
        settings = _swarm_settings(config)  # reads the swarm key: fails before any loading
        served = config.served()
        if not served:
            log.info("holding no model: this node coordinates the swarm's models")
            return cls(config, identity, [], settings)
        from swarmd.acquire import acquire
        from swarmd.engine import native
        from swarmd.model.loader import load_model
        from swarmd.model.threads import keep_this_thread_single_threaded

        keep_this_thread_single_threaded()  # only the torch workers run OpenMP teams
        native.configure(config.native_kernels)
        models: list[LoadedModel] = []
        for spec in served:
            # Settled before anything loads: the files (fetched from peers if need be) and
            # the layer range (chosen from the swarm's coverage with --layers auto).
            one = config.for_model(spec)
            acquired = acquire(one, identity, settings)
            models.append(
                load_model(acquired.source, acquired.layers or None, one.weights, one.dtype)
            )
            release_free_heap()
            more = tuple(a for a in acquired.peer_addrs if a not in config.bootstrap)
            if more:
                config = dataclasses.replace(config, bootstrap=config.bootstrap + more)
                settings = dataclasses.replace(settings, bootstrap=config.bootstrap)
        ids = [m.model_id for m in models]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"two of the models to serve have the same id: {', '.join(ids)}")
        return cls(config, identity, models, settings)

    # --- the first model held: what a single-model node (and its tests) means ------------

    @property
    def first(self) -> HeldModel:
        for held in self.held.values():
            return held
        raise InternalError("this node holds no model")

    @property
    def model(self) -> LoadedModel:
        return self.first.model

    @property
    def runtime(self) -> StageRuntime:
        return self.first.runtime

    @property
    def kv_budget(self) -> KVBudget:
        return self.first.kv_budget

    @property
    def model_ids(self) -> list[str]:
        """The models this node holds layers of, in order."""
        return list(self.held)

    async def start(self) -> None:
        logging.getLogger("swarmd").addHandler(self.failures)
        await self.bridge.start()
        if self.held:
            # The stage service parses and builds hidden states with torch ops in the trio
            # thread: keep it out of OpenMP like the loop's thread (threads.py says why),
            # before the workers set their own counts (part of what it sets is global).
            await self.bridge.run(_single_threaded)
        for held in self.held.values():
            held.worker.start()
        self.bridge.start_soon(self.swarm.run)
        try:
            await asyncio.wait_for(self.bridge.run(self.swarm.wait_ready), SWARM_START_TIMEOUT_S)
        except TimeoutError as exc:
            await self.stop()
            raise ConfigError(
                f"Could not join the swarm within {SWARM_START_TIMEOUT_S:g} s "
                f"(bootstrap: {', '.join(self.config.bootstrap) or 'none'})"
            ) from exc
        except SwarmError:
            await self.stop()
            raise
        self._runner = web.AppRunner(
            create_app(self),
            access_log=None,
            keepalive_timeout=self.config.http_keepalive_timeout_s,
        )
        await self._runner.setup()
        try:
            self._listener = await listen(
                self._runner, self.edge, self.config.host, self.config.port
            )
        except OSError as exc:
            await self.stop()
            raise ConfigError(
                f"Cannot listen on {self.config.host}:{self.config.port}: {exc.strerror} "
                "(is another node using that port? try --port)"
            ) from exc
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.api_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        # The first record went out before the API listened: renew it with the API address.
        await self.bridge.run(self.swarm.announce_now)

    async def stop(self) -> None:
        await self._leave_sessions()
        await self.forwards.close()
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner closes the open ones
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        try:
            await self.bridge.stop()  # withdraws this node's records on the way out
        except SwarmError as exc:
            log.warning("the swarm layer ended with an error: %s", exc)
        for held in self.held.values():
            await held.worker.stop()
        logging.getLogger("swarmd").removeHandler(self.failures)

    async def _leave_sessions(self) -> None:
        """Other peers' routes through this node fail over before it goes, without a ban:
        a restarted node (same peer id) is routable again as soon as it is back."""
        service = self._stage_service
        if service is None:
            return
        try:
            await self.bridge.run(service.leave, LEAVE_GRACE_S)
        except SwarmError as exc:  # the swarm layer is gone already: nobody to tell
            log.info("sessions not told of the shutdown: %s", exc)

    def _metrics_state(self) -> NodeState:
        def host_traffic(direction: str) -> dict[str, int]:
            host = self.swarm.host_or_none
            return dict(getattr(host.traffic, direction)) if host is not None else {}

        def connected() -> int:
            host = self.swarm.host_or_none
            return len(host.connected_peers()) if host is not None else 0

        def total(of: Callable[[HeldModel], int]) -> Callable[[], int]:
            return lambda: sum(of(held) for held in self.held.values())

        return NodeState(
            info=lambda: {
                "version": __version__,
                "peer_id": self.identity.peer_id,
                "model": ",".join(h.model.model_id for h in self.held.values()) or "none",
                "layers": ",".join(str(h.model.layers) for h in self.held.values()) or "none",
            },
            peers_connected=connected,
            kv_cache_tokens=total(lambda h: h.runtime.cached_tokens),
            sessions=total(lambda h: h.runtime.session_count),
            in_flight=lambda: self.coordinator.in_flight,
            bytes_sent=lambda: host_traffic("sent"),
            bytes_received=lambda: host_traffic("received"),
            records_rejected=lambda: self.swarm.rejected_records(),
            peers_banned=lambda: len(self.banned()),
            peers_sitting_out=lambda: len(self.sitting_out()),
            file_bytes_served=lambda: self.file_servers.bytes_sent if self.file_servers else 0,
            kv_budget_tokens=total(lambda h: h.kv_budget.total),
            kv_reserved_tokens=total(lambda h: h.kv_budget.reserved),
            queued_requests=lambda: self.coordinator.waiting,
            batch_rows=lambda: max((h.runtime.last_batch for h in self.held.values()), default=0),
            forwards=total(lambda h: h.runtime.batches),
            forward_rows=total(lambda h: h.runtime.batched_rows),
            background_errors=lambda: self.swarm.loop_errors.as_dict(),
            http_connections=lambda: self.edge.stats.open,
            http_refused=lambda: dict(self.edge.stats.refusals),
            joining=lambda: self.swarm.joining,
            reachability=lambda: self.swarm.reachability,
        )

    async def holders(self, model_id: str) -> list[NodeRecord]:
        """Every live holder of a model, this node included, as the swarm's background
        view has them (`dht.view`): only a model's first read walks the DHT."""
        view = self.swarm.view
        records = view.read(model_id)
        if records is None:
            records = await self.bridge.run(view.fetch, model_id)
        return self._same_variant(model_id, records)

    def _same_variant(self, model_id: str, records: list[NodeRecord]) -> list[NodeRecord]:
        """The holders a route of this node may use: only those of the same weights, split
        the same way (the same manifest, or none on both sides), held in the same format
        and computed in the same dtype. A hidden state means nothing to other weights, and
        a reply stays the one a single node of this kind gives. For a model this node
        coordinates without layers: the variant it chose (all of them until it has)."""
        held = self.held.get(model_id)
        if held is not None:
            variant = held.model.variant
        else:
            common = self._common.get(model_id)
            variant = common.variant if common is not None else None
        if variant is not None:
            records = [
                r
                for r in records
                if r.model_hash == variant.content_id
                and r.weights == variant.weights
                and r.dtype == variant.dtype_name
            ]
        return records

    def coordinated_models(self) -> list[CommonModel]:
        """The models this node has coordinated without holding layers of them."""
        return list(self._common.values())

    async def common_model(self, model_id: str) -> CommonModel:
        """A model of the swarm this node holds no layers of (`ModelFinder`): the variant
        its holders agree on, and its common files taken from them once (then from the
        cache, hashed again at first use)."""
        known = self._common.get(model_id)
        if known is not None:
            return known
        lock = self._common_locks.setdefault(model_id, asyncio.Lock())
        async with lock:  # concurrent first requests take the files once
            known = self._common.get(model_id)
            if known is not None:
                return known
            records = await self.bridge.run(self.swarm.holders, model_id)
            variant = choose_variant(model_id, records, self.model_ids)
            try:
                model = await self._load_common(model_id, variant, records)
            except (FetchError, ModelLoadError) as exc:  # a 503: the holders may do better
                raise CommonFilesError(f"Cannot coordinate {model_id} yet: {exc}") from exc
            log.info(
                "coordinating %s (%s, %s weights, %s) from the swarm's holders",
                model_id,
                variant.content_id[:16],
                variant.weights,
                variant.dtype_name,
            )
            self._common[model_id] = model  # from now on, holders are filtered by its variant
            return model

    async def _load_common(
        self, model_id: str, variant: Variant, records: list[NodeRecord]
    ) -> CommonModel:
        """The files taken (or found in the cache) and loaded, hashed once in the load. A
        cached file that no longer hashes right (a crash mid-write, a disk error) is
        taken again, once."""
        source = await self.bridge.run(self._take_common, model_id, variant, records)
        try:
            return await asyncio.to_thread(CommonModel.load, source, variant)
        except ShardHashError as exc:
            await asyncio.to_thread(Path(exc.path).unlink, missing_ok=True)
        source = await self.bridge.run(self._take_common, model_id, variant, records)
        return await asyncio.to_thread(CommonModel.load, source, variant)

    async def _take_common(
        self, model_id: str, variant: Variant, records: list[NodeRecord]
    ) -> ModelSource:
        """Trio side: the manifest and common files of `variant`, in the cache folder."""
        host = self.swarm.host
        cache_dir = Path(self.config.cache_dir)
        holders = [r for r in records if r.model_hash == variant.content_id]
        folder = fetch_folder(cache_dir, model_id, variant.content_id)
        try:  # taken before (the files are hashed again when loaded)
            raw = (folder / MANIFEST_FILE).read_bytes()
            manifest = parse_manifest(raw, expected_id=variant.content_id)
        except (OSError, ManifestError):
            manifest = await take_manifest(
                host, holders, model_id, variant.content_id, cache_dir, self.swarm.ban
            )

        async def lookup() -> list[NodeRecord]:
            found = await self.swarm.holders(model_id)
            return [r for r in found if r.model_hash == variant.content_id]

        settings = FetchSettings(deadline_s=self.config.fetch_timeout_s)
        wanted = list(manifest.files)
        size = sum(e.bytes for e in wanted)
        if size > MAX_COMMON_BYTES:  # a holder's manifest must not fill this node's disk
            raise ModelNotFoundError(
                model_id,
                self.model_ids,
                hint=f": its common files are {size / 1e6:.0f} MB, over the "
                f"{MAX_COMMON_BYTES / 1e6:.0f} MB a node takes to coordinate a model",
            )
        await fetch_missing(host, manifest, folder, wanted, lookup, self.swarm.ban, settings)
        return ModelSource(model_id, folder, manifest)

    def swarm_state(self) -> str:
        """ "ready"; "joining" while no bootstrap peer has answered (or every peer was
        lost); "stopped: <why>" when the swarm layer has failed."""
        failure = self.swarm.failure
        if failure is not None:
            return f"stopped: {failure}"
        if not self.bridge.running:
            return "stopped"
        return "joining" if self.swarm.joining else "ready"

    async def peer_snapshot(
        self,
    ) -> tuple[list[str], tuple[PeerRow, ...], dict[str, int], set[str]]:
        """Connected peers, the peer table, rejected records, and the connected peers
        reached only through a relay (see `SwarmPresence.snapshot`)."""
        try:
            return await self.bridge.run(self.swarm.snapshot)
        except SwarmError:  # the bridge stopped (shutdown, or a failed swarm layer)
            return [], (), {}, set()

    def bans(self, now: float) -> tuple[BanRow, ...]:
        return self.swarm.peers.bans(now)

    def outs(self, now: float) -> tuple[BanRow, ...]:
        """The lost peers sitting out of routes (`PeerTable.lose`)."""
        return self.swarm.peers.outs(now)

    def listen_addrs(self) -> list[str]:
        """Where peers reach this node: its announced addresses, else where it listens."""
        return list(self.swarm.announced)

    # --- what a distributed chain needs (pipeline.distributed.SwarmAccess) ---------------

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def stage_service(self) -> StageService:
        service = self._stage_service  # read once: the trio thread clears it at the end
        if service is None:
            raise InternalError("the stage service is not running")
        return service

    def rtt_ms(self) -> dict[str, float]:
        return {r.peer_id: r.rtt_ms for r in self.swarm.peers.snapshot() if r.rtt_ms is not None}

    def layer_ms(self) -> dict[str, float]:
        return self.swarm.peers.layer_ms(time.time())

    def measured(self, peer_id: str, layer_ms: float) -> None:
        self.swarm.peers.record_layer_ms(peer_id, layer_ms, time.time())

    def banned(self) -> set[str]:
        return {row.peer_id for row in self.swarm.peers.bans(time.time())}

    def sitting_out(self) -> set[str]:
        return {row.peer_id for row in self.swarm.peers.outs(time.time())}

    async def answering(self, peer_ids: set[str]) -> set[str]:
        return await self.bridge.run(self.swarm.answering, peer_ids)

    async def ban(self, peer_id: str, reason: str) -> None:
        await self.bridge.run(self.swarm.ban, peer_id, reason)

    async def lose(self, peer_id: str, reason: str) -> None:
        await self.bridge.run(self.swarm.lose, peer_id, reason)

    async def in_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return await self.bridge.run(fn, *args)

    async def _run_services(self, host: P2PHost) -> None:
        """Trio side: serve the models' files and the stage protocol while the host runs
        (a node holding no model serves its rings' return streams)."""
        settings = FileServeSettings(
            max_transfers=self.config.max_file_transfers,
            max_peer_transfers=self.config.max_peer_file_transfers,
            upload_bytes_per_s=self.config.upload_limit_mb_s * 1e6,
        )
        servers = [s for h in self.held.values() if (s := h.serve_files(settings)) is not None]
        if servers:
            self.file_servers = FileServers(servers)
            self.file_servers.register(self.swarm.rpc)
        timeouts = StageTimeouts(
            open_s=self.config.stage_open_timeout_s,
            idle_s=self.config.session_idle_timeout_s,
            step_s=self.config.step_timeout_s,
        )
        if any(held.model.is_whole for held in self.held.values()):
            # A model held whole answers peers' forwarded requests for it.
            ForwardService(host, self._execute_forward, self.forward_limits)
        stages = [held.stage(self.identity.peer_id) for held in self.held.values()]
        service = StageService(host, stages, self.swarm.ban, timeouts, self._signed_addrs)
        self._stage_service = service
        try:
            await service.run()
        finally:
            self._stage_service = None

    async def _execute_forward(
        self, path: str, body: bytes, peer_id: str, deliver: Deliver
    ) -> None:
        """Trio side: a peer's forwarded request, run on this node's API (asyncio)."""
        await self.bridge.to_asyncio(self.forwards.execute(path, body, peer_id, deliver))

    async def forward_holders(self, model_id: str) -> list[NodeRecord]:
        """The peers holding `model_id` whole that take forwarded requests, nearest first,
        for a model this node cannot route."""
        return self.forward_candidates(await self.holders(model_id))

    def forward_candidates(self, records: list[NodeRecord]) -> list[NodeRecord]:
        """Of `records`, the whole holders that take forwarded requests, nearest first."""
        banned = self.banned()
        rtt = self.rtt_ms()
        whole = [
            r
            for r in records
            if r.state == "ready"
            and r.layer_start == 0
            and r.layer_end == r.num_layers
            and r.peer_id != self.identity.peer_id
            and r.peer_id not in banned
            and version_tuple(r.version) >= FORWARD_SINCE
        ]
        return sorted(whole, key=lambda r: (rtt.get(r.peer_id, 1e9), r.peer_id))

    async def forward_to(self, peer_id: str, path: str, body: bytes, deliver: Deliver) -> None:
        """Forward a request to `peer_id` (`api.forward.ForwardAccess`)."""
        await self.bridge.run(
            forward, self.swarm.host, peer_id, path, body, deliver, self.forward_limits
        )

    async def _signed_addrs(self, peer_id: str, fresh: bool) -> frozenset[str] | None:
        """Trio side: the addresses `peer_id`'s signed record lists (None: no live record),
        for any model held here (a next hop serves the session's model, one of these):
        from the last lookups, or, `fresh`, from new ones (DHT walks)."""
        view = self.swarm.view
        for model_id in self.held:
            if fresh:
                records = await view.lookup_now(model_id)
            else:
                records = view.read(model_id) or []
            for record in records:
                if record.peer_id == peer_id:
                    return frozenset(record.addrs)
        return None

    def _make_index(self, host: P2PHost) -> list[ModelEntry]:
        """Trio side: the models this node serves, for the swarm's catalog."""
        return [held.index_entry() for held in self.held.values()]

    async def swarm_models(self) -> list[CatalogModel]:
        """The models the swarm's nodes list (this node's first), cached like holders."""
        cached = self._models_cache
        if cached is not None and time.monotonic() - cached[0] < MODELS_CACHE_S:
            return cached[1]
        models = await self.bridge.run(self.swarm.models)
        self._models_cache = (time.monotonic(), models)
        return models

    def _make_records(self, host: P2PHost) -> list[NodeRecord]:
        # Called in the trio thread. What it reads of the API's side is safe there: the
        # tokens-per-second ring is copied in one step, api_url is a plain string, and
        # the budgets a record reads hold locks.
        addrs = tuple(host.announced[:16])
        return [
            held.record(
                self.identity.peer_id,
                addrs,
                self.api_url,
                self.coordinator.recent_tokens_per_second(model_id),
                self.config.record_ttl_s,
            )
            for model_id, held in self.held.items()
        ]


async def _single_threaded() -> None:
    from swarmd.model.threads import keep_this_thread_single_threaded

    keep_this_thread_single_threaded()


# A prompt chunk may take this share of a step's time limit, by the held models' speed.
CHUNK_SHARE_OF_STEP = 0.25
MIN_PREFILL_CHUNK = 16


def prefill_chunk(config: Config, models: list[LoadedModel]) -> int:
    """Prompt tokens per forward step: `prefill_chunk_tokens`, fewer where a chunk of that
    many would take a held model (at its trial prefill's pace, every layer counted) more
    than a quarter of `step_timeout_s`: an 8B model on a slow CPU runs a long prompt in
    several steps instead of one that times out."""
    chunk = config.prefill_chunk_tokens
    budget = config.step_timeout_s * CHUNK_SHARE_OF_STEP
    for model in models:
        if model.prompt_token_s > 0 and chunk * model.prompt_token_s > budget:
            fits = max(MIN_PREFILL_CHUNK, int(budget / model.prompt_token_s))
            if fits < chunk:
                log.info(
                    "prompts run in chunks of %d tokens, not %d: a prompt token costs %s "
                    "about %.0f ms here, and a step must end within %.0f s",
                    fits,
                    chunk,
                    model.model_id,
                    model.prompt_token_s * 1000,
                    config.step_timeout_s,
                )
                chunk = fits
    return chunk


def check_api_exposure(config: Config) -> None:
    """Refuse to serve the API beyond loopback with nothing to keep strangers out."""
    if is_loopback_name(config.host):
        return
    if TokenStore(Path(config.data_dir)).enforced or config.require_api_token:
        return
    if config.allow_open_api:
        log.warning(
            "the API listens on %s with no API token: anyone who reaches it can use this "
            "node (allow_open_api is set)",
            config.host,
        )
        return
    raise ConfigError(
        f"The API would listen on {config.host}, beyond this machine, with no API token. "
        f"Create one first: swarmd token create --data-dir {config.data_dir} "
        "(clients then send 'Authorization: Bearer sk-swarm-...'), or set "
        "allow_open_api = true to serve it open"
    )


def _swarm_settings(config: Config) -> SwarmSettings:
    key = load_swarm_key(Path(config.swarm_key).expanduser()) if config.swarm_key else None
    default_port = config.port + 10 if config.port else 0  # a free API port: a free p2p one
    port = config.p2p_port if config.p2p_port >= 0 else default_port
    return SwarmSettings(
        listen_host=config.p2p_host,
        listen_port=port,
        bootstrap=config.bootstrap,
        republish_interval_s=config.republish_interval_s,
        swarm_key=key,
        known_peers_path=Path(config.data_dir).expanduser() / KNOWN_PEERS_FILE,
        announce=config.announce_addrs,
        listen=not config.no_listen,
        reachability=config.reachability,
        relay=RelaySettings(
            serve=config.relay_service,
            max_reservations=config.relay_max_reservations,
            max_circuits_per_peer=config.relay_max_circuits_per_peer,
            circuit_duration_s=config.relay_circuit_duration_s,
            circuit_mb=config.relay_circuit_mb,
        ),
    )


async def serve(config: Config) -> None:
    """Run a node until SIGINT or SIGTERM."""
    if config.served():
        from swarmd.model.threads import keep_this_thread_single_threaded

        keep_this_thread_single_threaded()  # the event loop's thread: see threads.py
    loop = asyncio.get_running_loop()
    node = await asyncio.to_thread(Node.prepare, config)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
        for addr in node.swarm.addrs:
            print(f"swarmd: p2p listening on {addr}", flush=True)
        if config.no_listen:
            print("swarmd: p2p takes no inbound connection; reached through a relay", flush=True)
        if config.relay_service:
            print("swarmd: relaying circuits for peers without inbound connections", flush=True)
        if config.announce_addrs:
            for addr in node.listen_addrs():
                print(f"swarmd: p2p announced as {addr}", flush=True)
        if node.swarm.joining:
            print(
                "swarmd: joining the swarm: no bootstrap peer answers yet; "
                "serving what this node holds and retrying",
                flush=True,
            )
        for held in node.held.values():
            model = held.model
            print(
                f"swarmd: serving {model.model_id} (layers {model.layers} of "
                f"{model.num_layers}) at {node.api_url}/v1",
                flush=True,
            )
        if not node.held:
            print(
                f"swarmd: holding no model; answering for the swarm's models at {node.api_url}/v1",
                flush=True,
            )
        print(f'swarmd: node {node.identity.short_id} ready; try: swarmd chat "hello"', flush=True)
        await stop.wait()
        print("swarmd: shutting down", flush=True)
    finally:
        await node.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
