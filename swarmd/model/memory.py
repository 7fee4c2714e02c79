"""How much memory a layer needs, and how much this machine has free (for `--layers auto`).

Layer sizes come from safetensors headers (shapes and dtypes, no weights read) or, for a
model not on this machine yet, from its manifest's shard sizes. Sizes are in the format
the node will hold (`--weights`, `--dtype`), since that is what it holds in memory.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from pathlib import Path
from typing import Any

from swarmd.dtypes import (
    FLOAT_TAGS,
    INT4_GROUP,
    INT4_SUFFIXES,
    INT8_SUFFIXES,
    SAFETENSORS_ITEM,
    held_format,
    label_formats,
)
from swarmd.errors import ModelLoadError
from swarmd.model.layers import tensor_layer
from swarmd.model.manifest import Manifest
from swarmd.model.source import ModelSource

# Bytes a node holds per weight of each format (int4: 4 bits + a 16-bit scale and zero per
# 32 weights; int8: the per-row scale is negligible).
HELD_BYTES = {"int4": 0.5 + 4 / INT4_GROUP, "int8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}


KV_BYTES = 4  # the engine's and transformers' caches are float32
MIN_KV_TOKENS = 512  # a node that cannot cache this many tokens of its layers is refused
# What a serving node holds besides weights and KV caches (measured on the embedded model
# at 0.8: the interpreter, torch, the tokenizer, libp2p, aiohttp): 0.5-0.6 GB.
RUNTIME_FLOOR_BYTES = 600_000_000
KV_SHARE_OF_FREE = 0.5  # of the memory free after loading, what the KV budget may take
MAX_KV_BUDGET_TOKENS = 1 << 24


def kv_bytes_per_token(config: dict[str, Any], layers: int) -> int:
    """Cache bytes one token takes on `layers` layers of a model (keys and values)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return max(1, layers) * 2 * kv_heads * head_dim * KV_BYTES


def fit_error(
    what: str, weights_bytes: int, kv_bytes: int, available: int, where: str
) -> str | None:
    """Why a range does not fit (weights + the least KV + the runtime floor > what is
    available), naming every number; None when it fits."""
    needed = weights_bytes + kv_bytes + RUNTIME_FLOOR_BYTES
    if needed <= available:
        return None
    return (
        f"{what} needs {needed / 1e9:.2f} GB (weights {weights_bytes / 1e9:.2f} GB + KV cache "
        f"for {MIN_KV_TOKENS} tokens {kv_bytes / 1e9:.2f} GB + runtime "
        f"{RUNTIME_FLOOR_BYTES / 1e9:.1f} GB), {where} {available / 1e9:.2f} GB: serve fewer "
        "layers (--layers A:B, or --layers auto to pick a range that fits)"
    )


def auto_kv_budget_tokens(bytes_per_token: int) -> int:
    """Half the memory free now (after the weights), in tokens of this node's layers."""
    tokens = int(available_memory_bytes() * KV_SHARE_OF_FREE) // max(1, bytes_per_token)
    return max(1, min(tokens, MAX_KV_BUDGET_TOKENS))


def available_memory_bytes() -> int:
    """Memory the OS can give without swapping (MemAvailable), or free pages elsewhere."""
    available = _proc_kb("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return available
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def rss_bytes() -> int | None:
    """This process's resident memory (VmRSS); None where /proc does not tell."""
    return _proc_kb("/proc/self/status", "VmRSS:")


def total_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return None


def _proc_kb(path: str, key: str) -> int | None:
    """A `key: N kB` line of a /proc file, in bytes."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def layer_weight_bytes(
    source: ModelSource | None, manifest: Manifest | None, weights: str, dtype: str
) -> list[int]:
    """Bytes of weights per layer as this node would hold them (`--weights`, and `dtype`
    a concrete compute dtype name):
    the embeddings counted in layer 0, the final norm and the head (a copy of the
    embeddings when tied) in the last layer."""
    if source is not None and source.gguf is not None:  # exact, from its tensor index
        return _gguf_layer_bytes(source.model_dir, weights, dtype)
    if manifest is not None:
        # A shard's bytes are spread over formats it does not say; take the largest growth
        # any of its formats would see (a mixed int4+int8 model sized as if all int8).
        stored = label_formats(manifest.weights) or {"fp32"}
        ratio = max(HELD_BYTES[held_format(f, weights, dtype)] / HELD_BYTES[f] for f in stored)
        return [math.ceil(b * ratio) for b in manifest.layer_bytes()]
    if source is None:
        raise ModelLoadError("no model to size: neither a folder nor a manifest")
    return _folder_layer_bytes(source.model_dir, weights, dtype)


def _gguf_layer_bytes(meta: Path, weights: str, dtype: str) -> list[int]:
    """Per-layer held bytes of a GGUF model, from its tensor index (no weights read)."""
    from swarmd.model.gguf_convert import plan  # torch, gguf: only a node placing layers
    from swarmd.model.gguf_index import read_index

    config = json.loads((meta / "config.json").read_text())
    num_layers = int(config["num_hidden_layers"])
    architecture, entries = read_index(meta)
    layer_of = {e.name: e.layer for e in entries}
    out = [0] * num_layers
    sizes: dict[str, int] = {}
    for p in plan(entries, config, architecture, weights):
        per = HELD_BYTES[held_format(p.fmt, weights, dtype)] if len(p.shape) == 2 else 4.0
        sizes[p.name] = math.ceil(math.prod(p.shape) * per)
        layer = layer_of.get(p.gguf_name)
        if p.name == "model.embed_tokens.weight":
            continue  # read from the file row by row (engine.load): no copy held
        if layer is None:  # the final norm and the head count in the last layer
            layer = num_layers - 1
        if 0 <= layer < num_layers:
            out[layer] += sizes[p.name]
    if "lm_head.weight" not in sizes:  # a tied head: the last stage holds its own copy
        out[-1] += sizes.get("model.embed_tokens.weight", 0)
    return out


def _folder_layer_bytes(model_dir: Path, weights: str, dtype: str) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = int(config["num_hidden_layers"])
    out = [0] * num_layers
    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        sizes.update(safetensors_sizes(file, weights, dtype))
    for name, size in sizes.items():
        layer = tensor_layer(name, num_layers)
        if layer is not None and 0 <= layer < num_layers:
            out[layer] += size
    if config.get("tie_word_embeddings") and "lm_head.weight" not in sizes:
        out[-1] += sizes.get("model.embed_tokens.weight", 0)  # the last stage's own head
    return out


def safetensors_sizes(path: Path, weights: str, dtype: str) -> dict[str, int]:
    """Tensor name (a quantized matrix once, by its own name) -> bytes as held."""
    # tensorfile imports torch at import time; a coordinator sizes nothing, so only a
    # node placing layers pays for it.
    from swarmd.model.tensorfile import read_header

    header, _ = read_header(path)
    sizes: dict[str, int] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            continue
        tag = str(info.get("dtype"))
        count = math.prod(int(d) for d in info.get("shape", []))
        for suffix, fmt, per_item in _COMPANIONS:
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                sizes[base] = math.ceil(
                    count * per_item * HELD_BYTES[held_format(fmt, weights, dtype)]
                )
                break
        else:
            if name.endswith(_SCALES):
                continue  # counted with its matrix
            if tag in FLOAT_TAGS:
                fmt = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(tag, "fp32")
                per = (
                    HELD_BYTES[held_format(fmt, weights, dtype)]
                    if len(info.get("shape", [])) == 2
                    else SAFETENSORS_ITEM[tag]
                )
                sizes[name] = math.ceil(count * per)
            else:
                sizes[name] = count * SAFETENSORS_ITEM.get(tag, 4)
    return sizes


# (suffix of the stored values, their format, weights per stored item)
_COMPANIONS = ((INT4_SUFFIXES[0], "int4", 2.0), (INT8_SUFFIXES[0], "int8", 1.0))
_SCALES = (*INT4_SUFFIXES[1:], *INT8_SUFFIXES[1:])


# --- the C heap -------------------------------------------------------------------------

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 128 * 1024


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def keep_large_blocks_returnable() -> None:
    """Serve every block over 128 KiB from its own mapping, returned to the OS on free.

    glibc raises its mmap threshold (up to 32 MB) after the first large free, so the
    temporaries of loading (stored tensors, int32 copies for packing) stay in the heap.
    Measured loading the embedded model in int4: peak 387 MB by default, 322 MB with the
    threshold fixed.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (after loading)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
