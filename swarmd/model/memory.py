"""How much memory a layer needs, and how much this machine has free (for `--layers auto`).

Layer sizes come from safetensors headers (shapes and dtypes, no weights read) or, for a
model not on this machine yet, from its manifest's shard sizes. Sizes are in the dtype the
node will run (`--dtype`), since that is what it holds in memory.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from swarmd.errors import ModelLoadError
from swarmd.model.layers import tensor_layer
from swarmd.model.manifest import Manifest
from swarmd.model.source import ModelSource

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# safetensors dtype tags -> bytes per item
_SAFETENSORS_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_SAFETENSORS_ITEM |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_MAX_HEADER_BYTES = 100 * 1024 * 1024


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
    source: ModelSource | None, manifest: Manifest | None, dtype: str
) -> list[int]:
    """Bytes of weights per layer at `dtype`: the embeddings counted in layer 0, the final
    norm and the head (a copy of the embeddings when tied) in the last layer."""
    if manifest is not None:
        stored = ITEM_BYTES.get(manifest.dtype)
        scale = ITEM_BYTES[dtype] / stored if stored else 1.0
        return [math.ceil(b * scale) for b in manifest.layer_bytes()]
    if source is None:
        raise ModelLoadError("no model to size: neither a folder nor a manifest")
    return _folder_layer_bytes(source.model_dir, ITEM_BYTES[dtype])


def _folder_layer_bytes(model_dir: Path, float_bytes: int) -> list[int]:
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = int(config["num_hidden_layers"])
    out = [0] * num_layers
    sizes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        sizes.update(safetensors_sizes(file, float_bytes))
    for name, size in sizes.items():
        layer = tensor_layer(name, num_layers)
        if layer is not None and 0 <= layer < num_layers:
            out[layer] += size
    if config.get("tie_word_embeddings") and "lm_head.weight" not in sizes:
        out[-1] += sizes.get("model.embed_tokens.weight", 0)  # the last stage's own head
    return out


def safetensors_sizes(path: Path, float_bytes: int) -> dict[str, int]:
    """Tensor name -> bytes, floating tensors counted at `float_bytes` per item."""
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ModelLoadError(f"{path} has no safetensors header")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read the safetensors header of {path}: {exc}") from exc
    sizes: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        tag = str(info.get("dtype"))
        item = float_bytes if tag in _FLOAT_TAGS else _SAFETENSORS_ITEM.get(tag, 4)
        sizes[name] = math.prod(int(d) for d in info.get("shape", [])) * item
    return sizes
