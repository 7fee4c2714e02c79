"""Model files between nodes (trio): a holder serves its manifest and verified files.

Two remote calls on `/swarmd/rpc/1` (one framing, one timeout per call, see `rpc.py`):

    manifest    {"model": content_id}                       -> {"manifest": bin}
    file_chunk  {"model": content_id, "file": str, "index": int} -> {"data": bin}

A chunk is the `index`-th `chunk_bytes` piece of the file, as the manifest cuts it, so
the caller checks it against the manifest's chunk hash on arrival. A holder serves the
manifest's files that are in its folder and match their hash: the ones it loaded were
verified at start-up; any other (a seed node may hold every shard and serve only a few
layers) is hashed the first time a peer asks for it. Nothing else on its disk is served.

Limits: at most `max_transfers` transfers at once (a transfer is one peer fetching one
file; it stays counted until its last chunk or until idle for TRANSFER_IDLE_S), at most
`max_peer_transfers` of them (and as many chunks in flight) for one peer, so one peer
cannot take every slot, and an optional upload rate shared by all of them. A peer over a
cap gets an `OverloadedError` answer and tries another holder.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from swarmd.errors import MalformedFrameError, ModelNotFoundError, OverloadedError
from swarmd.model.hashing import file_sha256
from swarmd.model.manifest import MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES, FileEntry, Manifest
from swarmd.net.host import P2PHost
from swarmd.net.rpc import RpcHandler, RpcService, call
from swarmd.untrusted import Bytes, Int, Schema, Str

log = logging.getLogger(__name__)

METHOD_MANIFEST = "manifest"
METHOD_CHUNK = "file_chunk"
TRANSFER_IDLE_S = 15.0  # a transfer with no chunk asked for this long no longer counts
MANIFEST_TIMEOUT_S = 10.0
CHUNK_TIMEOUT_S = 60.0  # one chunk, including a wait under the upload limit
_MAX_NAME_CHARS = 128
_MAX_MODEL_CHARS = 128  # a content id is 64 hex digits; longer is simply not held here

# Each call's request and reply, declared once and read with `swarmd.untrusted`'s
# readers. What needs the manifest (is the model held, is the index a chunk of that
# file) is checked in code, as a ModelNotFoundError or MalformedFrameError.
_MODEL = ("model", Str(_MAX_MODEL_CHARS))
MANIFEST_REQUEST = Schema("manifest request", (_MODEL,))
CHUNK_REQUEST = Schema(
    "file_chunk request", (_MODEL, ("file", Str(_MAX_NAME_CHARS)), ("index", Int(0)))
)
MANIFEST_REPLY = Schema("manifest reply", (("manifest", Bytes(MAX_MANIFEST_BYTES)),))
CHUNK_REPLY = Schema("file_chunk reply", (("data", Bytes(MAX_CHUNK_BYTES)),))
_REPLIES = {"manifest": MANIFEST_REPLY, "data": CHUNK_REPLY}


@dataclass(frozen=True)
class FileServeSettings:
    max_transfers: int = 4  # peers x files being served at once
    max_peer_transfers: int = 2  # of those, files one peer is fetching at once
    upload_bytes_per_s: float = 0.0  # shared by every transfer; 0 = no limit


class FileServer:
    """The holder side for one model: its manifest and the files this node verified."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        verified: list[FileEntry],
        settings: FileServeSettings,
        paths: Mapping[str, Path] | None = None,
    ) -> None:
        self._folder = folder
        self._paths = dict(paths or {})  # files that lie elsewhere (a GGUF read in place)
        self._manifest = manifest
        self._manifest_bytes = manifest.to_json()
        self._content_id = manifest.content_id
        self._checked: dict[str, bool] = {entry.file: True for entry in verified}
        self._checking = trio.Lock()
        self._settings = settings
        self._active: dict[tuple[str, str], float] = {}  # (peer, file) -> last chunk time
        self._in_flight: dict[str, int] = {}  # peer -> chunk calls being served to it
        self._next_free = 0.0  # when the upload limit lets the next byte out (trio clock)
        self.bytes_sent = 0

    def register(self, rpc: RpcService) -> None:
        self.register_as(rpc, self.rpc_manifest, self.rpc_file_chunk)

    def register_as(self, rpc: RpcService, manifest: RpcHandler, chunk: RpcHandler) -> None:
        """Register the two calls with these handlers (`FileServers`: its dispatchers)."""
        rpc.register(METHOD_MANIFEST, manifest, max_concurrency=8)
        rpc.register(
            METHOD_CHUNK,
            chunk,
            max_concurrency=2 * self._settings.max_transfers,
            timeout_s=CHUNK_TIMEOUT_S,
        )

    @property
    def content_id(self) -> str:
        return self._content_id

    @property
    def active_transfers(self) -> int:
        self._expire(trio.current_time())
        return len(self._active)

    async def rpc_manifest(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        self._check_model(MANIFEST_REQUEST.read(args, _bad_frame(peer_id))["model"])
        return {"manifest": self._manifest_bytes}

    async def rpc_file_chunk(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        request = CHUNK_REQUEST.read(args, _bad_frame(peer_id))
        self._check_model(request["model"])
        name, index = request["file"], request["index"]
        entry = self._manifest.entry(name)
        if entry is None or not await self._holds(entry):
            raise ModelNotFoundError(f"{self._content_id[:12]}/{name[:_MAX_NAME_CHARS]}")
        chunks = len(entry.chunks)
        if index >= chunks:
            raise MalformedFrameError(f"file_chunk: index must be in 0..{chunks - 1}", peer_id)
        # Chunks in flight per peer are capped too: one peer asking for many chunks at
        # once (of one file) would otherwise hold every call slot of the handler.
        if self._in_flight.get(peer_id, 0) >= self._settings.max_peer_transfers:
            raise OverloadedError("this node is serving your peer as many chunks as it may")
        self._admit(peer_id, name, last=index == chunks - 1)
        self._in_flight[peer_id] = self._in_flight.get(peer_id, 0) + 1
        try:
            offset, length = entry.chunk_span(index, self._manifest.chunk_bytes)
            await self._pace(length)
            data = await trio.to_thread.run_sync(_read, self._path(name), offset, length)
        finally:
            left = self._in_flight.pop(peer_id) - 1
            if left:
                self._in_flight[peer_id] = left
        self.bytes_sent += len(data)
        return {"data": data}

    async def _holds(self, entry: FileEntry) -> bool:
        """Whether the file is here and matches the manifest (hashed once, then known)."""
        known = self._checked.get(entry.file)
        if known is not None:
            return known
        async with self._checking:  # one hash at a time; served files never wait here
            if entry.file not in self._checked:
                path = self._path(entry.file)
                actual = await trio.to_thread.run_sync(_sha256_or_none, path)
                if actual is None:
                    return False  # not here (yet): asked again next time, not remembered
                self._checked[entry.file] = actual == entry.sha256
                if actual != entry.sha256:
                    log.warning(
                        "not serving %s: SHA-256 %s, the manifest says %s",
                        path,
                        actual,
                        entry.sha256,
                    )
            return self._checked[entry.file]

    def _path(self, name: str) -> Path:
        return self._paths.get(name) or self._folder / name

    def _check_model(self, model: str) -> None:
        if model != self._content_id:
            raise ModelNotFoundError(f"{model[:80]} (this node holds {self._content_id})")

    def _admit(self, peer_id: str, name: str, last: bool) -> None:
        now = trio.current_time()
        self._expire(now)
        key = (peer_id, name)
        if key not in self._active:
            if len(self._active) >= self._settings.max_transfers:
                raise OverloadedError(
                    f"this node is serving {len(self._active)} transfers already (its cap)"
                )
            mine = sum(1 for peer, _ in self._active if peer == peer_id)
            if mine >= self._settings.max_peer_transfers:
                raise OverloadedError(
                    f"this node is serving your peer {mine} files already (its cap per peer)"
                )
        if last:
            self._active.pop(key, None)
        else:
            self._active[key] = now

    def _expire(self, now: float) -> None:
        for key, seen in list(self._active.items()):
            if now - seen > TRANSFER_IDLE_S:
                del self._active[key]

    async def _pace(self, length: int) -> None:
        """Hold a chunk back until the upload limit lets its bytes out."""
        rate = self._settings.upload_bytes_per_s
        if rate <= 0:
            return
        now = trio.current_time()
        start = max(now, self._next_free)
        self._next_free = start + length / rate
        await trio.sleep_until(self._next_free)


class FileServers:
    """The holder side for every model this node holds: one registration of the two
    calls, each dispatched to the server of the content id it names. Each model keeps its
    own transfer caps and upload pacing."""

    def __init__(self, servers: list[FileServer]) -> None:
        self._servers = {server.content_id: server for server in servers}
        self._any = servers[0]  # answers for a content id not held here: it says so

    def register(self, rpc: RpcService) -> None:
        self._any.register_as(rpc, self.rpc_manifest, self.rpc_file_chunk)

    @property
    def bytes_sent(self) -> int:
        return sum(server.bytes_sent for server in self._servers.values())

    def _server(self, args: dict[str, Any]) -> FileServer:
        named = args.get("model") if isinstance(args, dict) else None
        return self._servers.get(named, self._any) if isinstance(named, str) else self._any

    async def rpc_manifest(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        return await self._server(args).rpc_manifest(peer_id, args)

    async def rpc_file_chunk(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        return await self._server(args).rpc_file_chunk(peer_id, args)


def _sha256_or_none(path: Path) -> str | None:
    return file_sha256(path) if path.is_file() else None


def _read(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read(length)


# --- the caller side --------------------------------------------------------------------


async def call_manifest(
    host: P2PHost, peer_id: str, content_id: str, timeout_s: float = MANIFEST_TIMEOUT_S
) -> bytes:
    """The raw manifest a peer holds for `content_id` (check it with parse_manifest)."""
    result = await call(host, peer_id, METHOD_MANIFEST, {"model": content_id}, timeout_s)
    return _bin(result, "manifest", peer_id)


async def call_file_chunk(
    host: P2PHost,
    peer_id: str,
    content_id: str,
    file: str,
    index: int,
    timeout_s: float = CHUNK_TIMEOUT_S,
) -> bytes:
    """Chunk `index` of a file, unchecked: the caller compares it with the manifest."""
    args = {"model": content_id, "file": file, "index": index}
    result = await call(host, peer_id, METHOD_CHUNK, args, timeout_s)
    return _bin(result, "data", peer_id)


def _bad_frame(peer_id: str) -> functools.partial[MalformedFrameError]:
    """The error the readers raise for what `peer_id` sent: a bad frame from that peer."""
    return functools.partial(MalformedFrameError, peer_id=peer_id)


def _bin(result: dict[str, Any], key: str, peer_id: str) -> bytes:
    """The one bytes field `key` of a reply (`manifest` or `data`), read by its schema."""
    reply: bytes = _REPLIES[key].read(result, _bad_frame(peer_id))[key]
    return reply


def transfer_rate(size: int, seconds: float) -> str:
    if seconds <= 0 or not math.isfinite(seconds):
        return "-"
    return f"{size / seconds / 1e6:.1f} MB/s"
