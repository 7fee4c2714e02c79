"""The manifest of a sharded model: what its files are and the hashes they must have.

A manifest (`manifest.json`, written by `swarmd shard`) names the model id, the
architecture and its config, the number of layers, the format the weights are stored
in, the files every node needs (tokenizer, chat template, generation config) and the
shards: each a layer range [start, end) with file name, size, SHA-256 and the SHA-256
of every `chunk_bytes` piece of it. The chunk hashes let a node that fetches a shard
from peers check each piece as it arrives, so a holder that sends wrong bytes is caught
at the first bad chunk and a broken transfer resumes from the last good one.

The manifest's **content id** is the SHA-256 of its canonical JSON (keys sorted, no
spaces, ASCII) without the `content_id` field. It is the model's identity in DHT records:
two nodes with the same content id hold the same weights, split the same way.

This module is pure: `parse_manifest` treats its input as hostile (it may come from a
peer) and checks every field before anything uses it. Hashing files lives in `shards.py`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from swarmd.dtypes import WEIGHT_FORMATS, label_formats
from swarmd.errors import ManifestError
from swarmd.model.layers import LayerRange, tiling_problem

MANIFEST_FORMAT = "swarmd-manifest/2"  # /2: the weights field
MANIFEST_FILE = "manifest.json"
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # one frame per chunk; 4 MiB ran at ~115 MB/s here
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 8 * 1024 * 1024  # leaves room under the 16 MiB frame limit
MAX_MANIFEST_BYTES = 8 * 1024 * 1024  # 2,000 chunk hashes per 8 GB shard: far below
MAX_FILE_BYTES = 1 << 40
MAX_FILES = 4096
MAX_LAYERS = 10_000
MAX_ID_CHARS = 128
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = frozenset(
    {
        "format",
        "model_id",
        "architecture",
        "config",
        "num_layers",
        "dtype",
        "weights",
        "chunk_bytes",
        "files",
        "shards",
    }
)
_FILE_KEYS = frozenset({"file", "bytes", "sha256", "chunks"})
_SHARD_KEYS = _FILE_KEYS | {"start", "end"}


@dataclass(frozen=True)
class FileEntry:
    file: str  # a plain name inside the model's folder
    bytes: int
    sha256: str  # lowercase hex of the whole file
    chunks: tuple[str, ...]  # lowercase hex of each chunk_bytes piece, in order

    def chunk_span(self, index: int, chunk_bytes: int) -> tuple[int, int]:
        """(offset, length) of chunk `index`: every chunk is full but the last."""
        offset = index * chunk_bytes
        return offset, min(chunk_bytes, self.bytes - offset)


@dataclass(frozen=True)
class ShardEntry(FileEntry):
    start: int = 0
    end: int = 0

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.start, self.end)


@dataclass(frozen=True)
class Manifest:
    model_id: str
    architecture: str  # the config's model_type, e.g. "llama"
    config: dict[str, Any]  # the Hugging Face config.json, as a dict
    num_layers: int
    dtype: str  # the dtypes the tensors are stored in, joined by '+'
    weights: str  # how the layer matrices are stored: int4, int8, bf16, ... or int4+int8
    chunk_bytes: int
    files: tuple[FileEntry, ...]  # every node needs these (tokenizer, templates)
    shards: tuple[ShardEntry, ...]  # in layer order, covering [0, num_layers) once

    @functools.cached_property
    def content_id(self) -> str:
        return hashlib.sha256(_canonical(self.body())).hexdigest()

    def body(self) -> dict[str, Any]:
        """The manifest as JSON data, without its content id."""
        return {
            "format": MANIFEST_FORMAT,
            "model_id": self.model_id,
            "architecture": self.architecture,
            "config": self.config,
            "num_layers": self.num_layers,
            "dtype": self.dtype,
            "weights": self.weights,
            "chunk_bytes": self.chunk_bytes,
            "files": [_file_json(f) for f in self.files],
            "shards": [{"start": s.start, "end": s.end, **_file_json(s)} for s in self.shards],
        }

    def to_json(self) -> bytes:
        """The file's bytes: readable, with the content id in it for people to see."""
        data = {**self.body(), "content_id": self.content_id}
        return (json.dumps(data, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()

    def shards_for(self, layers: LayerRange) -> list[ShardEntry]:
        """The shards a node serving `layers` must hold (every one that overlaps)."""
        return [s for s in self.shards if s.start < layers.end and layers.start < s.end]

    def files_for(self, layers: LayerRange) -> list[FileEntry]:
        """Every file a node serving `layers` needs: the common files, then its shards."""
        return [*self.files, *self.shards_for(layers)]

    def entry(self, name: str) -> FileEntry | None:
        for entry in (*self.files, *self.shards):
            if entry.file == name:
                return entry
        return None

    def layer_bytes(self) -> list[int]:
        """Bytes of weights per layer, each shard spread over its layers.

        The embeddings fall on the first shard's layers and the head on the last one's:
        rough per layer, exact per shard, which is what a node loads.
        """
        out: list[int] = []
        for shard in self.shards:
            size = shard.end - shard.start
            share, extra = divmod(shard.bytes, size)
            out.extend(share + (1 if i < extra else 0) for i in range(size))
        return out


def chunk_count(size: int, chunk_bytes: int) -> int:
    return math.ceil(size / chunk_bytes)


def _file_json(entry: FileEntry) -> dict[str, Any]:
    return {
        "file": entry.file,
        "bytes": entry.bytes,
        "sha256": entry.sha256,
        "chunks": list(entry.chunks),
    }


def _canonical(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# --- reading a manifest (untrusted) -----------------------------------------------------


def parse_manifest(raw: bytes, expected_id: str | None = None) -> Manifest:
    """Check and build a manifest; `expected_id`: the content id it must have.

    Raises ManifestError naming the first rule broken.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(raw)} bytes is over {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"manifest is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError("manifest is not a JSON object")
    claimed = data.pop("content_id", None)
    _exact_keys(data, _TOP_KEYS, "manifest")
    if data["format"] != MANIFEST_FORMAT:
        raise ManifestError(
            f"manifest format {str(data['format'])[:40]!r} is not {MANIFEST_FORMAT}"
        )
    model_id = _text(data["model_id"], "model_id")
    architecture = _text(data["architecture"], "architecture")
    config = data["config"]
    if not isinstance(config, dict):
        raise ManifestError("manifest config is not an object")
    num_layers = _int(data["num_layers"], "num_layers", 1, MAX_LAYERS)
    if config.get("model_type") != architecture:
        raise ManifestError("manifest config's model_type is not its architecture")
    if config.get("num_hidden_layers") != num_layers:
        raise ManifestError("manifest config's num_hidden_layers is not its num_layers")
    dtype = _text(data["dtype"], "dtype")
    weights = _text(data["weights"], "weights")
    if not label_formats(weights) or not label_formats(weights) <= set(WEIGHT_FORMATS):
        raise ManifestError(f"manifest weights {weights[:40]!r} are not of {WEIGHT_FORMATS}")
    chunk_bytes = _int(data["chunk_bytes"], "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    files = tuple(_file(item, chunk_bytes, "files") for item in _list(data["files"], "files"))
    shards = tuple(_shard(item, chunk_bytes) for item in _list(data["shards"], "shards"))
    _check_layout(num_layers, shards)
    _check_names([f.file for f in (*files, *shards)])
    manifest = Manifest(
        model_id, architecture, config, num_layers, dtype, weights, chunk_bytes, files, shards
    )
    actual = manifest.content_id
    for wanted, what in ((claimed, "its own content_id field"), (expected_id, "the id asked for")):
        if wanted is not None and wanted != actual:
            raise ManifestError(f"manifest content id {actual} is not {what} ({str(wanted)[:70]})")
    return manifest


def _exact_keys(data: dict[str, Any], keys: frozenset[str], what: str) -> None:
    if set(data) != keys:
        missing, extra = sorted(keys - set(data)), sorted(set(data) - keys)
        raise ManifestError(f"{what}: missing {missing}, unknown {[str(k)[:40] for k in extra]}")


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ManifestError(f"manifest {what} is not a string of 1..{MAX_ID_CHARS} characters")
    return value


def _int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ManifestError(f"manifest {what} is not an integer in {low}..{high}")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_FILES:
        raise ManifestError(f"manifest {what} is not a list of at most {MAX_FILES}")
    return value


def _file(
    item: object, chunk_bytes: int, what: str, keys: frozenset[str] = _FILE_KEYS
) -> FileEntry:
    if not isinstance(item, dict):
        raise ManifestError(f"an entry of manifest {what} is not an object")
    _exact_keys(item, keys, f"an entry of manifest {what}")
    name = item["file"]
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
        raise ManifestError(f"manifest file name {str(name)[:60]!r} is not a plain file name")
    size = _int(item["bytes"], f"{name} bytes", 0, MAX_FILE_BYTES)
    sha = _hex(item["sha256"], f"{name} sha256")
    chunks = item["chunks"]
    if not isinstance(chunks, list) or len(chunks) != chunk_count(size, chunk_bytes):
        raise ManifestError(
            f"manifest {name}: {chunk_count(size, chunk_bytes)} chunk hashes expected"
        )
    return FileEntry(name, size, sha, tuple(_hex(c, f"{name} chunk") for c in chunks))


def _shard(item: object, chunk_bytes: int) -> ShardEntry:
    if not isinstance(item, dict):
        raise ManifestError("an entry of manifest shards is not an object")
    entry = _file(item, chunk_bytes, "shards", _SHARD_KEYS)
    start = _int(item["start"], f"{entry.file} start", 0, MAX_LAYERS)
    end = _int(item["end"], f"{entry.file} end", 1, MAX_LAYERS)
    return ShardEntry(entry.file, entry.bytes, entry.sha256, entry.chunks, start, end)


def _hex(value: object, what: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise ManifestError(f"manifest {what} is not 64 lowercase hex digits")
    return value


def _check_layout(num_layers: int, shards: Iterable[ShardEntry]) -> None:
    problem = tiling_problem(((s.start, s.end) for s in shards), num_layers)
    if problem is not None:
        raise ManifestError(
            f"manifest shards must cover layers 0:{num_layers} in order, once each: {problem}"
        )


def _check_names(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise ManifestError("manifest names one file twice")
    if MANIFEST_FILE in names:
        raise ManifestError(f"manifest lists {MANIFEST_FILE} as one of its own files")
