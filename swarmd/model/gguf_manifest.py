"""The manifest of a GGUF file read in place: its content id, and its hashes.

A GGUF model is given the same identity a sharded one has: a `Manifest` whose common
files are its metadata folder's tokenizer files and whose one shard is the GGUF file
itself (named `GGUF_SHARD` in the manifest, wherever it lies on disk), with the SHA-256
of the whole file and of every chunk. Its content id goes into the DHT records, so a
route joins only holders of the same file (two files both named "llama-8b" are two
models to it), a `--no-model` gateway takes the tokenizer from a holder by that id, and
a node that lacks the file fetches it from holders checking every chunk.

The file is hashed once (a sequential read at disk speed; seconds for an 8B file) and
remembered by path, size and modification time in the cache's `gguf-digests.json`: a
file that changed is hashed again, and its content id with it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from swarmd.dtypes import weights_label
from swarmd.errors import ManifestError, ShardHashError
from swarmd.model.hashing import file_sha256, hash_file
from swarmd.model.manifest import (
    COMMON_FILES,
    DEFAULT_CHUNK_BYTES,
    FileEntry,
    Manifest,
    ShardEntry,
    parse_manifest,
)

log = logging.getLogger(__name__)

GGUF_SHARD = "weights.gguf"  # the file's name in the manifest (a plain name on any disk)
GGUF_DTYPE = "gguf:"  # the manifest's dtype of a GGUF: this, then the tensor types
_MEMO = "gguf-digests.json"


def is_gguf_manifest(manifest: Manifest) -> bool:
    """Whether the manifest describes one GGUF file read in place (not safetensors shards)."""
    return manifest.dtype.startswith(GGUF_DTYPE) and [s.file for s in manifest.shards] == [
        GGUF_SHARD
    ]


def gguf_manifest(gguf: Path, meta: Path, model_id: str, models: Path) -> Manifest:
    """The manifest of `gguf` (metadata folder `meta`), built once per file version."""
    key = f"manifest|{model_id}|{version_key(gguf)}"
    content_id = read_memo(models).get(key)
    if isinstance(content_id, str):
        try:
            raw = (meta / f"manifest-{content_id}.json").read_bytes()
            return parse_manifest(raw, expected_id=content_id)
        except (OSError, ManifestError):
            pass  # gone or damaged: built again below
    manifest = _build(gguf, meta, model_id, models)
    scratch = meta / f".manifest-{manifest.content_id}.tmp"
    scratch.write_bytes(manifest.to_json())
    os.replace(scratch, meta / f"manifest-{manifest.content_id}.json")
    remember(models, key, manifest.content_id)
    return manifest


def _build(gguf: Path, meta: Path, model_id: str, models: Path) -> Manifest:
    from swarmd.model.gguf_index import read_index
    from swarmd.model.gguf_tensors import GgufTensors  # torch, gguf: only on a new file

    config = json.loads((meta / "config.json").read_text())
    num_layers = int(config["num_hidden_layers"])
    with GgufTensors(gguf, meta, "auto") as tensors:
        formats = tensors.formats_of_layers(0, num_layers)
    qtypes = sorted({entry.qtype.lower() for entry in read_index(meta)[1]})
    started = time.monotonic()
    whole, chunks = hash_file(gguf, DEFAULT_CHUNK_BYTES)
    size = gguf.stat().st_size
    log.info(
        "hashed %s once (%.2f GB, %d chunks) in %.1f s: its content id goes into the records",
        gguf.name,
        size / 1e9,
        len(chunks),
        time.monotonic() - started,
    )
    remember(models, version_key(gguf), whole)  # what `verify_gguf` checks against
    common = []
    for name in COMMON_FILES:
        path = meta / name
        if path.is_file():
            digest, pieces = hash_file(path, DEFAULT_CHUNK_BYTES)
            common.append(FileEntry(name, path.stat().st_size, digest, pieces))
    shard = ShardEntry(GGUF_SHARD, size, whole, chunks, start=0, end=num_layers)
    return Manifest(
        model_id=model_id,
        architecture=str(config["model_type"]),
        config=config,
        num_layers=num_layers,
        dtype=GGUF_DTYPE + "+".join(qtypes),
        weights=weights_label(formats or {"fp32"}),
        chunk_bytes=DEFAULT_CHUNK_BYTES,
        files=tuple(common),
        shards=(shard,),
    )


def verify_gguf(gguf: Path, manifest: Manifest, models: Path) -> None:
    """ShardHashError unless `gguf` is the manifest's file (hashed once per file version:
    a file fetched from peers, or one that changed on disk since its manifest)."""
    entry = manifest.shards[0]
    actual = remembered_sha256(gguf, models)
    if actual != entry.sha256:
        raise ShardHashError(str(gguf), entry.sha256, actual)


def remembered_sha256(gguf: Path, models: Path) -> str:
    """The file's SHA-256, remembered by path, size and mtime: hashing a 4 GB file on
    every start would cost seconds."""
    key = version_key(gguf)
    digest = read_memo(models).get(key)
    if isinstance(digest, str) and len(digest) == 64:
        return digest
    started = time.monotonic()
    digest = file_sha256(gguf)
    log.info("hashed %s in %.1f s", gguf, time.monotonic() - started)
    remember(models, key, digest)
    return digest


def version_key(gguf: Path) -> str:
    """One version of a file: its path, size and modification time."""
    stat = gguf.stat()
    return f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def read_memo(models: Path) -> dict[str, object]:
    try:
        known = json.loads((models / _MEMO).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def remember(models: Path, key: str, value: str) -> None:
    models.mkdir(parents=True, exist_ok=True)
    with exclusive(models / "gguf-digests.lock"):
        current = {**read_memo(models), key: value}  # read again: another node may have added
        scratch = models / f"{_MEMO}.tmp"
        scratch.write_text(json.dumps(current, indent=1) + "\n")
        os.replace(scratch, models / _MEMO)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
