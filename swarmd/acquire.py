"""Before a node loads anything: which model files, which layers, fetched if need be.

`acquire(config, identity)` settles the node's `ModelSource` and layer range:

- a local model (the embedded id, a GGUF file, a Hugging Face folder, a sharded folder)
  with an explicit range needs nothing from the swarm;
- `--layers auto` asks the swarm which layers are covered and picks a range
  (`pipeline.placement.choose_layers`, sized by the memory budget);
- a model id that is not on this machine (or a sharded folder that lacks the files of
  the range) is fetched: its holders are found through the DHT, the manifest is taken
  from one of them (checked against the content id their records name), and the files
  of the range are downloaded chunk by chunk (`net.fetch.Fetcher`) with a progress bar.

The swarm part runs in its own short trio run, on a host that joins without announcing
anything: the node announces only once it has loaded and verified what it serves. It
blocks: the node calls it from its start-up thread.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import trio

from swarmd.config import Config
from swarmd.dht.records import NodeRecord
from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.dtypes import AUTO, default_compute_dtype, label_formats
from swarmd.errors import FetchError, ModelLoadError, ModelNotFoundError, SwarmError
from swarmd.model.hashing import missing_files
from swarmd.model.layers import LayerRange
from swarmd.model.manifest import MANIFEST_FILE, Manifest
from swarmd.model.memory import (
    MIN_KV_TOKENS,
    available_memory_bytes,
    fit_error,
    kv_bytes_per_token,
    layer_weight_bytes,
)
from swarmd.model.source import EMBEDDED_MODEL_ID, ModelSource, manifest_source, resolve_model
from swarmd.net.identity import Identity
from swarmd.net.progress import RichProgress
from swarmd.pipeline.placement import Placement, choose_layers
from swarmd.transfer.fetch import FetchSettings
from swarmd.transfer.take import fetch_folder, fetch_missing, folder_stem, take_manifest

log = logging.getLogger(__name__)

WEIGHTS_SHARE = 0.8  # of the memory budget; the rest is for KV caches and activations
JOIN_TIMEOUT_S = 60.0
MAX_EXTRA_BOOTSTRAP = 8  # holders met while fetching, added to the bootstrap peers


@dataclass(frozen=True)
class Acquired:
    source: ModelSource
    layers: str  # "START:END", or "" for every layer
    # Addresses of the holders met on the way: more ways into the swarm than the
    # bootstrap peers alone, which may have left while the files were fetched.
    peer_addrs: tuple[str, ...] = ()


def acquire(config: Config, identity: Identity, settings: SwarmSettings) -> Acquired:
    """The model source and layer range this node will load (blocking), refused when it
    will not fit in memory."""
    acquired = _acquire(config, identity, settings)
    check_fits(config, acquired)
    return acquired


def check_fits(config: Config, acquired: Acquired) -> None:
    """ModelLoadError with the numbers when the range's weights, the least KV cache and
    the runtime floor exceed the memory budget (or what the machine has available)."""
    from swarmd.model.loader import read_config

    source = acquired.source
    model_config = read_config(source)
    per_layer = layer_weight_bytes(
        source, source.manifest, config.weights, _dtype(config, source, source.manifest)
    )
    layers = (
        LayerRange.parse(acquired.layers, len(per_layer))
        if acquired.layers
        else LayerRange(0, len(per_layer))
    )
    weights = sum(per_layer[layers.start : layers.end])
    kv = kv_bytes_per_token(model_config, layers.size) * MIN_KV_TOKENS
    if config.memory_budget_gb:
        available, where = int(config.memory_budget_gb * 1e9), "the memory budget is"
    else:
        available, where = available_memory_bytes(), "this machine has available"
    error = fit_error(f"layers {layers} of {source.model_id}", weights, kv, available, where)
    if error is not None:
        raise ModelLoadError(error)


def _acquire(config: Config, identity: Identity, settings: SwarmSettings) -> Acquired:
    cache_dir = Path(config.cache_dir)
    local = _local_source(config.model, cache_dir)
    wants_auto = config.layers == "auto"
    if local is not None and not wants_auto and not _lacks_files(local, config.layers):
        return Acquired(local, config.layers)
    if not config.bootstrap:
        return _without_swarm(config, local, cache_dir)
    job = _SwarmJob(config, identity, settings, local, cache_dir)
    return trio.run(job.run)


def _local_source(spec: str, cache_dir: Path) -> ModelSource | None:
    """The model on this machine, or None for an id to look for in the swarm."""
    try:
        return resolve_model(spec, cache_dir)
    except ModelNotFoundError:
        if Path(spec).expanduser().exists():
            raise  # a path that is there but is no model: say so, do not search
        return None


def _lacks_files(source: ModelSource, layers: str) -> bool:
    manifest = source.manifest
    if manifest is None or source.gguf is not None:  # a GGUF read in place: all here
        return False
    return bool(missing_files(source.model_dir, manifest.files_for(_wanted(manifest, layers))))


def _wanted(manifest: Manifest, layers: str) -> LayerRange:
    """The range `layers` names ("START:END"; "" = every layer) of a manifest's model."""
    if not layers:
        return LayerRange(0, manifest.num_layers)
    return LayerRange.parse(layers, manifest.num_layers)


def _without_swarm(config: Config, local: ModelSource | None, cache_dir: Path) -> Acquired:
    """No bootstrap: a cached copy of a fetched model, or this node is the whole swarm."""
    source = local or _cached(config.model, cache_dir)
    if source is None:
        raise ModelNotFoundError(
            config.model,
            [EMBEDDED_MODEL_ID],
            hint="; to fetch it from a swarm, give --bootstrap with a peer that serves it",
        )
    layers = config.layers
    if layers == "auto":
        placement = _place(config, source, source.manifest, [])
        layers = str(placement.layers)
    if _lacks_files(source, layers):
        raise FetchError(
            f"{source.model_dir} lacks files for layers {layers or 'all'}; give --bootstrap "
            "with a peer that serves them to fetch them"
        )
    return Acquired(source, layers)


def _cached(model_id: str, cache_dir: Path) -> ModelSource | None:
    """The most recently fetched manifest of `model_id` in the cache, if any."""
    found = sorted(
        (cache_dir / "shards").glob(f"{folder_stem(model_id)}-*/{MANIFEST_FILE}"),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        return None
    source = resolve_model(str(found[-1]), cache_dir)
    return source if source.model_id == model_id else None


def _place(
    config: Config, source: ModelSource | None, manifest: Manifest | None, held: list[LayerRange]
) -> Placement:
    budget = (
        int(config.memory_budget_gb * 1e9) if config.memory_budget_gb else available_memory_bytes()
    )
    per_layer = layer_weight_bytes(
        source, manifest, config.weights, _dtype(config, source, manifest)
    )
    placement = choose_layers(len(per_layer), per_layer, held, int(budget * WEIGHTS_SHARE))
    log.info(
        "--layers auto chose %s: %s (memory budget %.1f GB%s, %d%% of it for weights)",
        placement.layers,
        placement.reason,
        budget / 1e9,
        "" if config.memory_budget_gb else ", the memory free now",
        int(WEIGHTS_SHARE * 100),
    )
    return placement


def _dtype(config: Config, source: ModelSource | None, manifest: Manifest | None) -> str:
    """The compute dtype the node will run (what `--dtype auto` resolves to)."""
    if config.dtype != AUTO:
        return config.dtype
    if config.weights != AUTO:
        stored = {config.weights}
    elif manifest is not None:
        stored = label_formats(manifest.weights)
    elif source is not None:
        from swarmd.model.loader import model_formats

        stored = model_formats(source)
    else:
        stored = set()
    from swarmd.model.loader import cpu_capability

    return default_compute_dtype(frozenset(stored), cpu_capability())


class _SwarmJob:
    """The trio part: join, find the holders, take a manifest, place, fetch."""

    def __init__(
        self,
        config: Config,
        identity: Identity,
        settings: SwarmSettings,
        local: ModelSource | None,
        cache_dir: Path,
    ) -> None:
        self._config = config
        self._local = local
        self._cache_dir = cache_dir
        # The node's own port: peers that saw this host keep dialing the address the
        # node will listen on once it serves (the same peer id, the same address).
        self._presence = SwarmPresence(identity, settings, None)
        self._records: list[NodeRecord] = []  # the holders the last lookup found

    async def run(self) -> Acquired:
        acquired: Acquired | None = None
        failure: SwarmError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._presence.run)
            try:
                acquired = await self._acquire()
            except SwarmError as exc:
                failure = exc  # raised below, not wrapped in the nursery's exception group
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if acquired is None:
            raise FetchError("the swarm layer stopped before the model's files were settled")
        return acquired

    async def _acquire(self) -> Acquired:
        with trio.move_on_after(JOIN_TIMEOUT_S) as joining:
            await self._presence.wait_joined()
        if joining.cancelled_caught:
            raise FetchError(
                f"Could not join the swarm within {JOIN_TIMEOUT_S:g} s to look for "
                f"the model's files (bootstrap: {', '.join(self._config.bootstrap)})"
            )
        acquired = await self._settle()
        own = self._presence.identity.peer_id
        # The holders seen last (before or while fetching): no second lookup for them.
        addrs = tuple(r.addrs[0] for r in self._records if r.peer_id != own and r.addrs)
        return Acquired(acquired.source, acquired.layers, addrs[:MAX_EXTRA_BOOTSTRAP])

    async def _holders(self, model_id: str) -> list[NodeRecord]:
        self._records = await self._presence.holders(model_id)
        return self._records

    async def _settle(self) -> Acquired:
        model_id = self._local.model_id if self._local is not None else self._config.model
        records = await self._holders(model_id)
        local_manifest = self._local.manifest if self._local is not None else None
        if self._local is not None and (local_manifest is None or self._local.gguf is not None):
            # A local GGUF file or Hugging Face folder, all here: the swarm only tells
            # which layers of the same content are covered.
            local = self._local
            held = [r.layers for r in records if r.model_hash == local.content_id]
            placement = _place(self._config, local, local_manifest, held)
            return Acquired(local, str(placement.layers))
        if local_manifest is not None:
            manifest, folder = local_manifest, self._local.model_dir  # type: ignore[union-attr]
        else:
            manifest = await self._take_manifest(model_id, records)
            folder = fetch_folder(self._cache_dir, model_id, manifest.content_id)
        same = [r for r in records if r.model_hash == manifest.content_id]
        layers = self._config.layers
        if layers == "auto":
            held = [r.layers for r in same]
            layers = str(_place(self._config, None, manifest, held).layers)
        await self._fetch(manifest, folder, model_id, _wanted(manifest, layers))
        return Acquired(manifest_source(folder, manifest), layers)

    async def _take_manifest(self, model_id: str, records: list[NodeRecord]) -> Manifest:
        """The manifest most holders announce, from the first holder that sends it intact."""
        ids = Counter(r.model_hash for r in records if r.model_hash)
        if not ids:
            why = (
                f": {len(records)} peer(s) serve it, all from a Hugging Face folder, "
                "without a manifest, so none can send its files"
                if records
                else ": no peer of the swarm serves it"
            )
            raise ModelNotFoundError(model_id, hint=why)
        content_id, count = ids.most_common(1)[0]
        if len(ids) > 1:
            log.warning(
                "peers serve %d versions of %s; taking %s (held by %d)",
                len(ids),
                model_id,
                content_id[:16],
                count,
            )
        return await take_manifest(
            self._presence.host, records, model_id, content_id, self._cache_dir, self._presence.ban
        )

    async def _fetch(
        self, manifest: Manifest, folder: Path, model_id: str, wanted: LayerRange
    ) -> None:
        entries = manifest.files_for(wanted)
        if not missing_files(folder, entries):
            return
        settings = FetchSettings(deadline_s=self._config.fetch_timeout_s)
        with RichProgress() as progress:
            await fetch_missing(
                self._presence.host,
                manifest,
                folder,
                entries,
                lambda: self._holders(model_id),
                self._presence.ban,
                settings,
                progress,
            )
