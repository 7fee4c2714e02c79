"""Hashing model files: SHA-256 of whole files and of their chunks, and verification
against a manifest before anything loads them."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from swarmd.errors import ModelLoadError, ShardHashError
from swarmd.model.manifest import FileEntry

log = logging.getLogger(__name__)

_READ_BYTES = 1 << 20


def hash_file(path: Path, chunk_bytes: int) -> tuple[str, tuple[str, ...]]:
    """SHA-256 of the whole file and of each `chunk_bytes` piece.

    Each piece is hashed twice (into the whole and on its own); the two run on two threads
    (hashlib lets go of the GIL), so a 5 GB GGUF hashes in about the time of one pass."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    pending: deque[Future[str]] = deque()
    with path.open("rb") as handle, ThreadPoolExecutor(max_workers=1) as pool:
        while piece := handle.read(chunk_bytes):
            pending.append(pool.submit(_hex, piece))
            whole.update(piece)
            while len(pending) > 2:  # a few pieces in memory at most
                chunks.append(pending.popleft().result())
        chunks.extend(f.result() for f in pending)
    return whole.hexdigest(), tuple(chunks)


def _hex(piece: bytes) -> str:
    return hashlib.sha256(piece).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def missing_files(folder: Path, entries: Iterable[FileEntry]) -> list[FileEntry]:
    return [e for e in entries if not (folder / e.file).is_file()]


def verify_files(folder: Path, entries: Iterable[FileEntry]) -> None:
    """Hash each file against its entry; ShardHashError names the file and both hashes."""
    started, total = time.monotonic(), 0
    for entry in entries:
        path = folder / entry.file
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing (the manifest lists it)")
        actual = file_sha256(path)
        if actual != entry.sha256:
            raise ShardHashError(str(path), entry.sha256, actual)
        total += entry.bytes
    log.info(
        "verified %.1f MB against the manifest in %.2f s", total / 1e6, time.monotonic() - started
    )
