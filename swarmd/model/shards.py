"""Shard files on disk: hashing, verification, and `swarmd shard` (the writer).

`write_shards` turns a Hugging Face folder (a GGUF file is converted to one first) into a
folder with `manifest.json`, one `.safetensors` file per layer range and the files every
node needs (tokenizer, chat template, generation config). Tensors keep their checkpoint
names (`model.layers.12.mlp...`), so the stage loader reads a shard like any checkpoint.
The embeddings go with the shard that starts at layer 0; the final norm and the LM head
with the shard that ends at the last layer, as `lm_head.weight` even when the model ties
it to the embeddings (a last shard without layer 0 has no embeddings to tie to).

`verify_files` hashes files against their manifest entries before anything loads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarmd.errors import ConfigError, ModelLoadError, ShardHashError
from swarmd.model.families import supported_model_types
from swarmd.model.layers import RECOMPUTED, LayerRange, tensor_layer, tiling_problem
from swarmd.model.manifest import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST_FILE,
    FileEntry,
    Manifest,
    ShardEntry,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Files a node needs beside the weights, when the source has them.
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
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_READ_BYTES = 1 << 20


# --- hashing and verification -----------------------------------------------------------


def hash_file(path: Path, chunk_bytes: int) -> tuple[str, tuple[str, ...]]:
    """SHA-256 of the whole file and of each `chunk_bytes` piece."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    with path.open("rb") as handle:
        while piece := handle.read(chunk_bytes):
            whole.update(piece)
            chunks.append(hashlib.sha256(piece).hexdigest())
    return whole.hexdigest(), tuple(chunks)


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


# --- the writer -------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    model_id: str
    source_dir: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer
    ranges: tuple[LayerRange, ...]
    out_dir: Path
    dtype: str | None = None  # cast floating tensors to this; None keeps the source's
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


def even_ranges(num_layers: int, stages: int) -> list[LayerRange]:
    """`stages` ranges whose sizes differ by one at most (the larger ones first)."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"--stages must be in 1..{num_layers} (the model's layers)")
    size, extra = divmod(num_layers, stages)
    ranges, at = [], 0
    for i in range(stages):
        end = at + size + (1 if i < extra else 0)
        ranges.append(LayerRange(at, end))
        at = end
    return ranges


def parse_ranges(text: str, num_layers: int) -> list[LayerRange]:
    """'0:10,10:20,20:30' -> ranges that must cover [0, num_layers) in order, once."""
    ranges = [LayerRange.parse(part.strip(), num_layers) for part in text.split(",") if part]
    problem = tiling_problem(((r.start, r.end) for r in ranges), num_layers)
    if problem is not None:
        raise ConfigError(
            f"--ranges must cover layers 0:{num_layers} in order with no gap or overlap: {problem}"
        )
    return ranges


def read_config(source_dir: Path) -> dict[str, object]:
    try:
        config = json.loads((source_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read {source_dir / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise ModelLoadError(f"{source_dir / 'config.json'} has no num_hidden_layers")
    if config.get("model_type") not in supported_model_types():
        raise ModelLoadError(
            f"Architecture '{config.get('model_type')}' is not supported; swarmd runs "
            f"{', '.join(supported_model_types())}"
        )
    return config


def write_shards(plan: ShardPlan) -> Manifest:
    """Write the shards, the common files and manifest.json into `plan.out_dir`."""
    from safetensors.torch import save_file

    from swarmd.model.loader import DTYPES
    from swarmd.model.stage import tensor_files

    config = read_config(plan.source_dir)
    num_layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    if not any((plan.source_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{plan.source_dir} has no tokenizer ({', '.join(_TOKENIZER_FILES)}): a node "
            "could load the shards but not answer a request"
        )
    _prepare_out(plan.out_dir)
    located = tensor_files(plan.source_dir)
    groups = _assign(located, plan.ranges, num_layers, bool(config.get("tie_word_embeddings")))
    cast = DTYPES[plan.dtype] if plan.dtype else None
    shards: list[ShardEntry] = []
    stored: set[str] = set()
    for layer_range, names in zip(plan.ranges, groups, strict=True):
        tensors = _read_tensors(located, names, cast)
        stored.update(str(t.dtype).removeprefix("torch.") for t in tensors.values())
        name = f"layers-{layer_range.start:05d}-{layer_range.end:05d}.safetensors"
        save_file(tensors, str(plan.out_dir / name), metadata={"format": "pt"})
        del tensors
        entry = _file_entry(plan.out_dir / name, plan.chunk_bytes)
        shards.append(ShardEntry(**vars(entry), start=layer_range.start, end=layer_range.end))
        log.info("wrote %s (layers %s, %.1f MB)", name, layer_range, entry.bytes / 1e6)
    files = []
    for name in COMMON_FILES:
        if (plan.source_dir / name).is_file():
            shutil.copyfile(plan.source_dir / name, plan.out_dir / name)
            files.append(_file_entry(plan.out_dir / name, plan.chunk_bytes))
    manifest = Manifest(
        model_id=plan.model_id,
        architecture=str(config["model_type"]),
        config=config,
        num_layers=num_layers,
        dtype="+".join(sorted(stored)),
        chunk_bytes=plan.chunk_bytes,
        files=tuple(files),
        shards=tuple(shards),
    )
    scratch = plan.out_dir / f".{MANIFEST_FILE}.tmp"
    scratch.write_bytes(manifest.to_json())
    os.replace(scratch, plan.out_dir / MANIFEST_FILE)  # last: a manifest means complete
    return manifest


def _prepare_out(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty; choose a new --out folder")
    out_dir.mkdir(parents=True, exist_ok=True)


def _assign(
    located: dict[str, Path], ranges: Iterable[LayerRange], num_layers: int, tied: bool
) -> list[list[tuple[str, str]]]:
    """For each range, (name in the shard, name in the checkpoint) of its tensors.

    Every checkpoint tensor must land in some shard: a tensor this does not know would
    otherwise be dropped without a word.
    """
    ranges = list(ranges)
    groups: list[list[tuple[str, str]]] = [[] for _ in ranges]
    last = len(ranges) - 1
    for name in sorted(located):
        layer = tensor_layer(name, num_layers)
        if layer == RECOMPUTED:
            continue
        if layer is None:
            raise ModelLoadError(f"Tensor '{name}' belongs to no layer range; cannot shard it")
        index = next((i for i, r in enumerate(ranges) if r.start <= layer < r.end), None)
        if index is None:
            raise ModelLoadError(f"Tensor '{name}' is for layer {layer}, past {num_layers}")
        groups[index].append((name, name))
    if tied and "lm_head.weight" not in located:
        groups[last].append(("lm_head.weight", "model.embed_tokens.weight"))
    return groups


def _read_tensors(
    located: dict[str, Path], names: list[tuple[str, str]], cast: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The tensors of one shard, each source file opened once, cast when asked."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for out_name, ckpt_name in names:
        by_file.setdefault(located[ckpt_name], []).append((out_name, ckpt_name))
    tensors: dict[str, torch.Tensor] = {}
    for file, pairs in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for out_name, ckpt_name in pairs:
                tensor = handle.get_tensor(ckpt_name)
                if cast is not None and tensor.is_floating_point():
                    tensor = tensor.to(cast)
                tensors[out_name] = tensor.contiguous().clone()
    return tensors


def _file_entry(path: Path, chunk_bytes: int) -> FileEntry:
    whole, chunks = hash_file(path, chunk_bytes)
    return FileEntry(path.name, path.stat().st_size, whole, chunks)
