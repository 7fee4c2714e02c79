"""Taking a model's files from its holders: the manifest (checked against the content id
their records name), then any of the files it lists, into the user cache.

Used before a node loads (`acquire`: the files of the layers it will serve) and while it
runs (the common files of a model it coordinates without holding layers: the tokenizer,
templates and config, `manifest.files`). Trio side; every peer is checked as `Fetcher`
checks it, and one that sends a bad manifest is banned.
"""

from __future__ import annotations

import fcntl
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from swarmd.dht.records import NodeRecord
from swarmd.errors import FetchError, ManifestError, PeerError
from swarmd.model.hashing import missing_files
from swarmd.model.manifest import MANIFEST_FILE, FileEntry, Manifest, parse_manifest
from swarmd.net.host import P2PHost
from swarmd.net.progress import Progress
from swarmd.transfer.fetch import Fetcher, FetchSettings
from swarmd.transfer.files import call_manifest

log = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")

Ban = Callable[[str, str], Awaitable[None]]
Lookup = Callable[[], Awaitable[list[NodeRecord]]]


def fetch_folder(cache_dir: Path, model_id: str, content_id: str) -> Path:
    """Where the files of one content id of a model go in the cache."""
    return cache_dir / "shards" / f"{folder_stem(model_id)}-{content_id[:16]}"


def folder_stem(model_id: str) -> str:
    """A model id as the start of a folder name in the cache."""
    return _SAFE_ID.sub("-", model_id)


async def take_manifest(
    host: P2PHost,
    records: list[NodeRecord],
    model_id: str,
    content_id: str,
    cache_dir: Path,
    ban: Ban,
) -> Manifest:
    """`content_id`'s manifest from the first of its holders that sends it intact, written
    to its cache folder."""
    for record in records:
        if record.model_hash != content_id:
            continue
        try:
            raw = await call_manifest(host, record.peer_id, content_id)
            manifest = parse_manifest(raw, expected_id=content_id)
        except PeerError as exc:
            log.warning("no manifest from %s: %s", record.peer_id[-8:], exc)
            continue
        except ManifestError as exc:
            await ban(record.peer_id, f"sent a bad manifest: {exc}")
            continue
        folder = fetch_folder(cache_dir, model_id, content_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_FILE).write_bytes(manifest.to_json())
        log.info(
            "took the manifest of %s (%s) from %s", model_id, content_id[:16], record.peer_id[-8:]
        )
        return manifest
    raise FetchError(f"No holder of {model_id} ({content_id[:12]}) sent its manifest")


async def fetch_missing(
    host: P2PHost,
    manifest: Manifest,
    folder: Path,
    wanted: list[FileEntry],
    lookup: Lookup,
    ban: Ban,
    settings: FetchSettings,
    progress: Progress | None = None,
) -> None:
    """Fetch the files of `wanted` the folder lacks, under the folder's lock: two nodes
    sharing a cache fetch once (the second finds the files)."""
    async with _locked(folder.parent / f"{folder.name}.lock"):
        entries = missing_files(folder, wanted)
        if not entries:
            return
        log.info(
            "fetching %d file(s), %.1f MB, of %s from the swarm",
            len(entries),
            sum(e.bytes for e in entries) / 1e6,
            manifest.model_id,
        )
        fetcher = Fetcher(host, manifest, folder, lookup, ban, settings, progress)
        await fetcher.fetch(entries)


@asynccontextmanager
async def _locked(path: Path) -> AsyncIterator[None]:
    """An exclusive lock on `path`, waited for off the trio thread (another process may
    hold it for a while)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        await trio.to_thread.run_sync(fcntl.flock, handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
