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

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarmd.dtypes import AUTO, DENSE, head_format, weights_label
from swarmd.errors import ConfigError, ModelLoadError
from swarmd.model import quant
from swarmd.model.families import supported_model_types
from swarmd.model.hashing import hash_file
from swarmd.model.layers import RECOMPUTED, LayerRange, tensor_layer, tiling_problem
from swarmd.model.manifest import (
    COMMON_FILES,
    DEFAULT_CHUNK_BYTES,
    MANIFEST_FILE,
    FileEntry,
    Manifest,
    ShardEntry,
)
from swarmd.model.quant import StoredTensors, target_format
from swarmd.model.tensorfile import TensorSpec, TensorWriter, tensor_files

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_READ_BYTES = 1 << 20


# --- the writer -------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    model_id: str
    source_dir: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer
    ranges: tuple[LayerRange, ...]
    out_dir: Path
    weights: str = AUTO  # the layer matrices' format; auto keeps the source's
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
    config = read_config(plan.source_dir)
    num_layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    if not any((plan.source_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{plan.source_dir} has no tokenizer ({', '.join(_TOKENIZER_FILES)}): a node "
            "could load the shards but not answer a request"
        )
    _prepare_out(plan.out_dir)
    files = sorted(set(tensor_files(plan.source_dir).values()))
    shards: list[ShardEntry] = []
    stored: set[str] = set()
    matrix_formats: set[str] = set()
    with StoredTensors(files) as source:
        tied = bool(config.get("tie_word_embeddings"))
        groups = _assign(source.logical_names(), plan.ranges, num_layers, tied)
        for layer_range, names in zip(plan.ranges, groups, strict=True):
            name = f"layers-{layer_range.start:05d}-{layer_range.end:05d}.safetensors"
            written = _write_shard(source, names, plan.weights, plan.out_dir / name)
            for spec, fmt in written:
                stored.add(spec.tag)
                if fmt is not None:
                    matrix_formats.add(fmt)
            entry = _file_entry(plan.out_dir / name, plan.chunk_bytes)
            shards.append(ShardEntry(**vars(entry), start=layer_range.start, end=layer_range.end))
            log.info("wrote %s (layers %s, %.1f MB)", name, layer_range, entry.bytes / 1e6)
    common = []
    for name in COMMON_FILES:
        if (plan.source_dir / name).is_file():
            shutil.copyfile(plan.source_dir / name, plan.out_dir / name)
            common.append(_file_entry(plan.out_dir / name, plan.chunk_bytes))
    manifest = Manifest(
        model_id=plan.model_id,
        architecture=str(config["model_type"]),
        config=config,
        num_layers=num_layers,
        dtype="+".join(sorted(_TAG_NAMES.get(tag, tag.lower()) for tag in stored)),
        weights=weights_label(matrix_formats),
        chunk_bytes=plan.chunk_bytes,
        files=tuple(common),
        shards=tuple(shards),
    )
    scratch = plan.out_dir / f".{MANIFEST_FILE}.tmp"
    scratch.write_bytes(manifest.to_json())
    os.replace(scratch, plan.out_dir / MANIFEST_FILE)  # last: a manifest means complete
    return manifest


_TAG_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8"}


def _prepare_out(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty; choose a new --out folder")
    out_dir.mkdir(parents=True, exist_ok=True)


def _assign(
    names: Iterable[str], ranges: Iterable[LayerRange], num_layers: int, tied: bool
) -> list[list[tuple[str, str]]]:
    """For each range, (name in the shard, name in the checkpoint) of its tensors.

    Every checkpoint tensor must land in some shard: a tensor this does not know would
    otherwise be dropped without a word.
    """
    ranges = list(ranges)
    names = sorted(names)
    groups: list[list[tuple[str, str]]] = [[] for _ in ranges]
    last = len(ranges) - 1
    for name in names:
        layer = tensor_layer(name, num_layers)
        if layer == RECOMPUTED:
            continue
        if layer is None:
            raise ModelLoadError(f"Tensor '{name}' belongs to no layer range; cannot shard it")
        index = next((i for i, r in enumerate(ranges) if r.start <= layer < r.end), None)
        if index is None:
            raise ModelLoadError(f"Tensor '{name}' is for layer {layer}, past {num_layers}")
        groups[index].append((name, name))
    if tied and "lm_head.weight" not in names:
        groups[last].append(("lm_head.weight", "model.embed_tokens.weight"))
    return groups


def _shard_format(name: str, stored: str, shape: tuple[int, ...], weights: str) -> str:
    """The format tensor `name` is written in: --weights for the layer matrices, the
    tables' rule for embeddings and head, the dense format (or as stored) otherwise."""
    if weights == AUTO:
        return stored
    if _is_layer_matrix(name, shape):
        return target_format(weights, shape)
    if name in _TABLES:
        return target_format(head_format(weights), shape)
    return weights if weights in DENSE and stored in DENSE else stored


_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def _is_layer_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.startswith("model.layers.") and name.endswith(".weight")


def _write_shard(
    source: StoredTensors, names: list[tuple[str, str]], weights: str, path: Path
) -> list[tuple[TensorSpec, str | None]]:
    """Stream one shard's tensors into `path`, one at a time; returns each written spec
    with the format of the layer matrix it belongs to (None for other tensors)."""
    plans = []
    for out_name, src_name in names:
        stored, shape = source.format_and_shape(src_name)
        fmt = _shard_format(out_name, stored, shape, weights)
        kind = fmt if _is_layer_matrix(out_name, shape) else None
        plans.append((out_name, src_name, fmt, kind, quant.stored_specs(out_name, fmt, shape)))
    written: list[tuple[TensorSpec, str | None]] = []
    specs = [spec for *_, specs in plans for spec in specs]
    with TensorWriter(path, specs) as writer:
        for out_name, src_name, fmt, kind, out_specs in plans:
            matrix = quant.convert(source.matrix(src_name), fmt)
            for name, tensor in quant.file_tensors(out_name, matrix).items():
                writer.write(name, tensor.contiguous())
            written.extend((spec, kind) for spec in out_specs)
    return written


def _file_entry(path: Path, chunk_bytes: int) -> FileEntry:
    whole, chunks = hash_file(path, chunk_bytes)
    return FileEntry(path.name, path.stat().st_size, whole, chunks)
