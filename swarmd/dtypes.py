"""The one table of number formats in swarmd: how weights are held, how activations compute.

Two separate choices (DESIGN 3):

- **weights** (`--weights`): how a layer's matrices are held in memory and in files.
  `int4` = 4-bit integers in groups of INT4_GROUP values along a row, one float scale and
  zero per group (w = (q - 8) * scale + zero); `int8` = 8-bit integers with one scale per
  output row (w = q * scale); `bf16`, `fp16`, `fp32` = plain floats. `auto` = what the
  file already is (a GGUF's 4- and 5-bit tensors int4, its 6- and 8-bit ones int8, ...).
- **dtype** (`--dtype`): the float type activations compute in, and the type hidden states
  travel in between stages. `auto` = bfloat16 for quantized or bf16 weights where torch's
  CPU kernels are vectorised (AVX2 or AVX-512), float16 for fp16, float32 otherwise.

Config, loader, wire, manifests, records and memory sizing all read this table. Nothing
here imports torch at import time (the config is read before torch loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COMPUTE_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes
WEIGHT_FORMATS = ("int4", "int8", "bf16", "fp16", "fp32")
QUANTIZED = frozenset({"int4", "int8"})
DENSE: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
AUTO = "auto"
INT4_GROUP = 32  # values per int4 scale/zero pair along a row (GGUF's Q4 block size)

# A quantized tensor `X` is stored as several tensors named X + suffix (model/quant.py
# writes them; memory sizing reads them from headers without loading torch).
INT4_SUFFIXES = (".int4", ".int4_scale", ".int4_zero")
INT8_SUFFIXES = (".int8", ".int8_scale")

# Bytes per stored item of each safetensors dtype tag (file sizes, memory sizing).
SAFETENSORS_ITEM: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})

# torch's CPU capabilities whose int4/int8 kernels are vectorised for bfloat16 activations
# (measured: 10-20x the scalar path they take with float32 activations).
_BF16_FAST_CAPABILITIES = frozenset({"AVX2", "AVX512", "AVX512_BF16", "AMX"})


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a compute dtype name ('bfloat16' -> torch.bfloat16)."""
    import torch

    if name not in COMPUTE_DTYPES:
        raise ValueError(f"not a compute dtype: {name!r}")
    dtype = getattr(torch, name)
    return dtype  # type: ignore[no-any-return]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16; ValueError for a dtype activations never use."""
    name = str(dtype).removeprefix("torch.")
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"not a compute dtype: {dtype}")
    return name


def weights_label(formats: set[str] | frozenset[str]) -> str:
    """How a model's layer matrices are held, in one word for records and manifests:
    the format they all share, or the formats joined by '+' in table order."""
    return "+".join(f for f in WEIGHT_FORMATS if f in formats) or "fp32"


def label_formats(label: str) -> set[str]:
    return {part for part in label.split("+") if part}


def default_compute_dtype(weight_formats: set[str] | frozenset[str], cpu_capability: str) -> str:
    """The activation dtype for weights held in `weight_formats` on this CPU."""
    fast_bf16 = cpu_capability.upper() in _BF16_FAST_CAPABILITIES
    if weight_formats & (QUANTIZED | {"bf16"}):
        return "bfloat16" if fast_bf16 else "float32"
    if weight_formats == {"fp16"}:
        return "float16"
    return "float32"


DENSE_OF: dict[str, str] = {compute: fmt for fmt, compute in DENSE.items()}  # "bfloat16" -> "bf16"


def held_format(stored: str, weights: str, dtype_name: str) -> str:
    """The format a matrix stored as `stored` is held in, for `--weights` and `--dtype`
    (a concrete compute dtype name). `auto` keeps quantized matrices as they are and holds
    dense ones in the compute dtype (a float32 checkpoint run with --dtype bfloat16 holds
    bfloat16 weights)."""
    if weights != AUTO:
        return weights
    return stored if stored in QUANTIZED else DENSE_OF[dtype_name]


def head_format(weights: str) -> str:
    """How the embeddings and LM head are held when the layers are `weights`.

    int8 per row for quantized layers: one tensor serves both the embedding lookup and a
    tied head, and it keeps a GGUF's Q8_0 / Q6_K table at 8 bits (the head decides every
    token; see the README's measured figures). Dense layers: the same dense format.
    """
    return "int8" if weights in QUANTIZED else weights
