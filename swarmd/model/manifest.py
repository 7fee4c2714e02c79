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
peer) and checks every field before anything uses it: the `MANIFEST` schema, read with
`swarmd.untrusted`'s readers, then what spans fields in code. Hashing files lives in `shards.py`.
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
from swarmd.untrusted import Choice, Int, List, Raw, Reader, Schema, Str, Struct

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

# Files a node needs beside the weights, when the source has them (the
# config is in the manifest itself).
COMMON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


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


def _bad(message: str) -> ManifestError:
    return ManifestError(f"manifest {message}")


# Every field of a manifest with the bound it needs alone; the chunk count (from the
# size), the config's agreement, the layout and the names are checked in code.
_ID = Str(MAX_ID_CHARS, min_chars=1)
_HEX = Str(64, min_chars=64, pattern=_HEX64, what="64 lowercase hex digits")
_FILE_FIELDS: tuple[tuple[str, Reader[Any]], ...] = (
    ("file", Str(128, min_chars=1, pattern=_FILE_NAME, what="a plain file name")),
    ("bytes", Int(0, MAX_FILE_BYTES)),
    ("sha256", _HEX),
    ("chunks", Raw()),  # read in `_file`, once the size says how many
)
FILE = Schema("files entry", _FILE_FIELDS)
SHARD = Schema(
    "shards entry",
    (*_FILE_FIELDS, ("start", Int(0, MAX_LAYERS)), ("end", Int(1, MAX_LAYERS))),
)
MANIFEST = Schema(
    "object",
    (
        ("format", Choice((MANIFEST_FORMAT,), "manifest format")),
        ("model_id", _ID),
        ("architecture", _ID),
        ("config", Raw(dict, "an object")),
        ("num_layers", Int(1, MAX_LAYERS)),
        ("dtype", _ID),
        ("weights", _ID),
        ("chunk_bytes", Int(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)),
        ("files", List(Struct(FILE), MAX_FILES)),
        ("shards", List(Struct(SHARD), MAX_FILES)),
    ),
)


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
    top = MANIFEST.read(data, _bad)
    model_id, architecture, config = top["model_id"], top["architecture"], top["config"]
    num_layers, dtype, weights = top["num_layers"], top["dtype"], top["weights"]
    chunk_bytes = top["chunk_bytes"]
    if config.get("model_type") != architecture:
        raise ManifestError("manifest config's model_type is not its architecture")
    if config.get("num_hidden_layers") != num_layers:
        raise ManifestError("manifest config's num_hidden_layers is not its num_layers")
    if not label_formats(weights) or not label_formats(weights) <= set(WEIGHT_FORMATS):
        raise ManifestError(f"manifest weights {weights[:40]!r} are not of {WEIGHT_FORMATS}")
    files = tuple(_file(item, chunk_bytes) for item in top["files"])
    shards = tuple(_shard(item, chunk_bytes) for item in top["shards"])
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


def _file(entry: dict[str, Any], chunk_bytes: int) -> FileEntry:
    name, size, chunks = entry["file"], entry["bytes"], entry["chunks"]
    # The count of chunk hashes follows from the size: a bound no reader holds alone.
    if type(chunks) is not list or len(chunks) != chunk_count(size, chunk_bytes):
        raise ManifestError(
            f"manifest {name}: {chunk_count(size, chunk_bytes)} chunk hashes expected"
        )
    hashes = List(_HEX, None).read(chunks, f"{name} chunk", _bad)
    return FileEntry(name, size, entry["sha256"], tuple(hashes))


def _shard(entry: dict[str, Any], chunk_bytes: int) -> ShardEntry:
    base = _file(entry, chunk_bytes)
    return ShardEntry(base.file, base.bytes, base.sha256, base.chunks, entry["start"], entry["end"])


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
