"""`HeldModel`: one model a node holds layers of, with everything that computes it.

Its weights (`LoadedModel`), its stage runtime and torch worker, its KV budget (and the
part of it other peers may hold), and what the node announces of it: the record, the
catalog entry, the stage protocol's limits and the files it serves. A node holds several
of these, one, or none (`--no-model`): only this module and the modules under it import
torch, and the node imports it only once it holds a model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from swarmd import __version__
from swarmd.config import Config
from swarmd.dht.index import ModelEntry
from swarmd.dht.records import NodeRecord
from swarmd.model.loader import LoadedModel
from swarmd.model.memory import auto_kv_budget_tokens, kv_bytes_per_token
from swarmd.model.runtime import StageRuntime
from swarmd.model.worker import TorchWorker
from swarmd.model.worker_trio import run_job
from swarmd.pipeline.admission import KVBudget, PeerBudget, PeerLimits
from swarmd.pipeline.chain import Hop, StageChain
from swarmd.pipeline.local import LocalChain
from swarmd.pipeline.stage_service import HeldStage
from swarmd.pipeline.wire import StageLimits
from swarmd.transfer.files import FileServer, FileServeSettings


class HeldModel:
    def __init__(
        self,
        config: Config,
        model: LoadedModel,
        torch_threads: int,
        on_step: Callable[[float], None],
        kv_share: float = 1.0,
    ) -> None:
        """`kv_share`: the part of the memory-measured KV budget this model gets (the node
        holds 1 / kv_share models); `kv_budget_tokens`, when set, is each model's own."""
        self.model = model
        self.kv_bytes_per_token = kv_bytes_per_token(model.config, model.layers.size)
        measured = int(auto_kv_budget_tokens(self.kv_bytes_per_token) * kv_share)
        self.kv_budget = KVBudget(config.kv_budget_tokens or max(1, measured))
        # Other peers' stage sessions: their own part of the budget, capped per peer.
        self.peer_budget = PeerBudget(
            self.kv_budget,
            PeerLimits(
                kv_share=config.remote_kv_share,
                peer_kv_share=config.peer_kv_share,
                max_sessions=config.max_remote_sessions,
                max_peer_sessions=config.max_peer_sessions,
            ),
        )
        prefix = config.prefix_cache_tokens
        self.runtime = StageRuntime(
            model.stage,
            config.max_sessions + config.max_remote_sessions,  # peers never take ours
            on_step=on_step,
            prefix_tokens=self.kv_budget.total // 8 if prefix < 0 else prefix,
            constraints=model.constraint,
        )
        self.worker = TorchWorker(self.runtime, torch_threads)

    @property
    def model_id(self) -> str:
        return self.model.model_id

    def local_chain(self, hop: Hop, step_timeout_s: float) -> StageChain:
        return LocalChain(self.worker, hop, step_timeout_s)

    def stage(self, peer_id: str) -> HeldStage:
        """This model as the stage protocol serves it."""
        model = self.model
        limits = StageLimits(
            peer_id=peer_id,
            model_id=model.model_id,
            held=model.layers,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            vocab_size=model.vocab_size,
            context_length=model.context_length,
        )
        run = functools.partial(run_job, self.worker)
        return HeldStage(limits, model.hidden_dtype, run, self.kv_budget, self.peer_budget)

    def serve_files(self, settings: FileServeSettings) -> FileServer | None:
        """A server of this model's files to peers (None: no manifest, nothing to serve)."""
        manifest = self.model.source.manifest
        if manifest is None:
            return None
        # Verified at start-up: the files of its layers (others are hashed when asked for).
        verified = manifest.files_for(self.model.layers)
        source = self.model.source
        paths = {s.file: source.file_path(s.file) for s in manifest.shards}
        return FileServer(source.model_dir, manifest, verified, settings, paths)

    def index_entry(self) -> ModelEntry:
        model = self.model
        return ModelEntry(
            model.model_id, model.source.content_id, model.num_layers, model.context_length
        )

    def record(
        self,
        peer_id: str,
        addrs: tuple[str, ...],
        api_url: str,
        throughput_tps: float,
        ttl_s: float,
    ) -> NodeRecord:
        model = self.model
        peers = self.peer_budget
        return NodeRecord(
            peer_id=peer_id,
            model_id=model.model_id,
            model_hash=model.source.content_id,
            layer_start=model.layers.start,
            layer_end=model.layers.end,
            num_layers=model.num_layers,
            dtype=model.dtype_name,
            weights=model.weights,
            # What a session of another peer's route can get: the routes' 413 check
            # (route_capacity) must see the per-peer cap, or every stage would decline.
            free_kv_tokens=min(peers.free, peers.per_peer),
            # 0 when it takes no peer's sessions at all, so that nobody waits for its room.
            kv_budget_tokens=min(peers.per_peer, peers.total) if peers.limits.max_sessions else 0,
            throughput_tps=throughput_tps,
            state="ready",
            addrs=addrs,
            api_url=api_url,
            version=__version__,
            expires_at=time.time() + ttl_s,
        )
