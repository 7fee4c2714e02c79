"""`Fetcher`: download a model's files from the peers that hold them (trio).

Each file is written to `.<name>.part` chunk by chunk, every chunk checked against its
SHA-256 in the manifest as it arrives; the whole file is hashed once more before it is
renamed into place. A `.part` left by an interrupted run is checked chunk by chunk and
continued after its last good chunk, from whichever holder answers.

Holders are tried in order (those whose layer range covers the file first); the one that
works is kept. A holder that cannot serve (gone, busy, not holding the file) is set aside
for this file; one that sends wrong bytes is banned. When every holder has been set
aside, the holder list is looked up again, after a pause, until `deadline_s` passes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from swarmd.dht.records import NodeRecord
from swarmd.errors import FetchError, PeerError, RemoteError
from swarmd.model.hashing import file_sha256, missing_files
from swarmd.model.manifest import FileEntry, Manifest, ShardEntry
from swarmd.net.host import P2PHost
from swarmd.transfer.files import call_file_chunk, transfer_rate

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0  # before looking the holders up again when none could serve


class Progress(Protocol):
    def start(self, name: str, total: int, done: int) -> None: ...
    def advance(self, name: str, size: int) -> None: ...
    def finish(self, name: str) -> None: ...


class NoProgress:
    def start(self, name: str, total: int, done: int) -> None:
        pass

    def advance(self, name: str, size: int) -> None:
        pass

    def finish(self, name: str) -> None:
        pass


@dataclass(frozen=True)
class FetchSettings:
    chunk_timeout_s: float = 60.0  # one chunk from one holder
    deadline_s: float = 600.0  # a file with no holder able to serve it this long: give up


class Fetcher:
    def __init__(
        self,
        host: P2PHost,
        manifest: Manifest,
        folder: Path,
        lookup: Callable[[], Awaitable[list[NodeRecord]]],
        ban: Callable[[str, str], Awaitable[None]],
        settings: FetchSettings,
        progress: Progress | None = None,
    ) -> None:
        self._host = host
        self._manifest = manifest
        self._content_id = manifest.content_id
        self._folder = folder
        self._lookup = lookup
        self._ban = ban
        self._settings = settings
        self._progress = progress or NoProgress()
        self._banned: set[str] = set()
        self.bytes_fetched = 0

    async def fetch(self, entries: Sequence[FileEntry]) -> None:
        """Download every entry not yet in the folder; each is verified when this returns."""
        self._folder.mkdir(parents=True, exist_ok=True)
        # Files already here are left alone: the loader verifies them like any local file.
        for entry in missing_files(self._folder, entries):
            await self._fetch_file(entry)

    async def _fetch_file(self, entry: FileEntry) -> None:
        part = part_path(self._folder, entry.file)
        done = await trio.to_thread.run_sync(_resume_point, part, entry, self._manifest.chunk_bytes)
        if done:
            log.info("resuming %s after chunk %d of %d", entry.file, done, len(entry.chunks))
        self._progress.start(
            entry.file, entry.bytes, min(entry.bytes, done * self._manifest.chunk_bytes)
        )
        started, fetched = time.monotonic(), 0
        holders: list[str] = []
        looked = waiting = False
        serving = ""
        deadline = trio.current_time() + self._settings.deadline_s
        with part.open("r+b" if part.exists() else "wb") as handle:
            handle.seek(done * self._manifest.chunk_bytes)
            index = done
            while index < len(entry.chunks):
                if not holders:
                    holders = await self._holders_for(entry, deadline, pause_first=looked)
                    looked = True
                peer = holders[0]
                if peer != serving:
                    serving = peer
                    log.info("fetching %s from %s at chunk %d", entry.file, peer[-8:], index)
                data = await self._chunk(peer, entry, index)
                if data is None:
                    holders.pop(0)  # set aside for this file; the next holder takes over
                    if not holders and not waiting:
                        waiting = True
                        log.info(
                            "no holder could serve %s; asking the swarm again for up to %g s",
                            entry.file,
                            self._settings.deadline_s,
                        )
                    continue
                waiting = False
                await trio.to_thread.run_sync(handle.write, data)
                fetched += len(data)
                self.bytes_fetched += len(data)
                self._progress.advance(entry.file, len(data))
                index += 1
                deadline = trio.current_time() + self._settings.deadline_s
        await self._finish(part, entry)
        self._progress.finish(entry.file)
        elapsed = time.monotonic() - started
        log.info(
            "fetched %s (%.1f MB) in %.1f s, %s",
            entry.file,
            fetched / 1e6,
            elapsed,
            transfer_rate(fetched, elapsed),
        )

    async def _chunk(self, peer: str, entry: FileEntry, index: int) -> bytes | None:
        """Chunk `index` from `peer`, checked; None when that peer cannot serve it."""
        try:
            data = await call_file_chunk(
                self._host,
                peer,
                self._content_id,
                entry.file,
                index,
                self._settings.chunk_timeout_s,
            )
        except RemoteError as exc:
            # Not holding the file, or busy: an answer, not a fault; try the next holder.
            log.debug("%s cannot serve %s now: %s", peer[-8:], entry.file, exc.remote_message)
            return None
        except PeerError as exc:
            log.warning("fetching %s from %s failed: %s", entry.file, peer[-8:], exc)
            return None
        _, length = entry.chunk_span(index, self._manifest.chunk_bytes)
        actual = hashlib.sha256(data).hexdigest()
        if len(data) != length or actual != entry.chunks[index]:
            why = (
                f"sent wrong bytes for {entry.file} chunk {index}: {len(data)} bytes with "
                f"SHA-256 {actual}, expected {length} bytes with {entry.chunks[index]}"
            )
            log.warning("DIAG: fetch refused a chunk peer=%s %s", peer[-8:], why)
            self._banned.add(peer)
            await self._ban(peer, why)
            return None
        return data

    async def _holders_for(self, entry: FileEntry, deadline: float, pause_first: bool) -> list[str]:
        """Holders to try for `entry`, best first; waits for some until `deadline`.

        `pause_first`: every holder known was tried; wait a little before asking again.
        """
        pause = pause_first
        while True:
            if pause:
                if trio.current_time() >= deadline:
                    raise FetchError(
                        f"No peer could supply {entry.file} of {self._manifest.model_id} "
                        f"({self._content_id[:12]}) for {self._settings.deadline_s:g} s"
                    )
                await trio.sleep(RETRY_PAUSE_S)
            pause = True
            records = [r for r in await self._lookup() if self._may_serve(r)]
            if records:
                return _order(records, entry)
            (log.info if not pause_first else log.debug)(
                "no holder of %s is known yet; looking again every %g s", entry.file, RETRY_PAUSE_S
            )

    def _may_serve(self, record: NodeRecord) -> bool:
        return (
            record.model_hash == self._content_id
            and record.peer_id != self._host.peer_id
            and record.peer_id not in self._banned
        )

    async def _finish(self, part: Path, entry: FileEntry) -> None:
        actual = await trio.to_thread.run_sync(file_sha256, part)
        if actual != entry.sha256:
            # Every chunk matched, so the manifest itself is inconsistent: start over.
            await trio.Path(part).unlink()
            raise FetchError(
                f"{entry.file} fetched chunk by chunk but hashes to {actual}, not {entry.sha256}"
            )
        os.replace(part, self._folder / entry.file)


def _order(records: list[NodeRecord], entry: FileEntry) -> list[str]:
    """Holders whose layers cover a shard first (they hold its file); random within a
    group, so several fetching nodes spread over the holders."""
    shuffled = list(records)
    random.shuffle(shuffled)

    def holds(record: NodeRecord) -> bool:
        if not isinstance(entry, ShardEntry):
            return True
        return record.layer_start < entry.end and entry.start < record.layer_end

    return [r.peer_id for r in sorted(shuffled, key=lambda r: not holds(r))]


def part_path(folder: Path, name: str) -> Path:
    """Where a file is written until it verifies. The leading dot keeps it apart from every
    name a manifest may list (those cannot start with a dot)."""
    return folder / f".{name}.part"


def _resume_point(part: Path, entry: FileEntry, chunk_bytes: int) -> int:
    """How many leading chunks of a `.part` file are good; cuts it after the last one."""
    if not part.exists():
        return 0
    good = 0
    with part.open("r+b") as handle:
        for expected in entry.chunks:
            piece = handle.read(chunk_bytes)
            if not piece or hashlib.sha256(piece).hexdigest() != expected:
                break
            good += 1
        handle.truncate(good * chunk_bytes if good < len(entry.chunks) else entry.bytes)
    return good
