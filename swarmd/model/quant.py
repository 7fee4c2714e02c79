"""Quantized weight matrices: int4 in groups of 32 along a row, int8 with a scale per row.

Two forms of each (a matrix is [N, K]: N output rows, K inputs):

- **stored** (files, the converted cache, shards; the same bytes on every machine):
  int4 = `values` uint8 [N, K/2], two per byte (even column in the low nibble), `scale`
  and `zero` float32 [N, K/32], w = (q - 8) * scale + zero; int8 = `values` int8 [N, K]
  and `scale` float32 [N], w = q * scale.
- **kernel** (what a stage holds, `engine.linear`): built at load by torch's
  `_convert_weight_to_int4pack_for_cpu`, whose layout depends on the CPU (blocks of 64
  rows on AVX-512, 32 on AVX2), so it never goes into a file.

GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly this int4 form (`int4_from_gguf`): Q4_0 is
scale d, zero 0; Q4_1 scale d, zero m + 8d; Q4_K scale d*sc, zero 8*d*sc - dmin*m, each
sub-block of 32 a group. Everything else is requantized from float32 once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from swarmd.dtypes import DENSE, INT4_GROUP, INT4_SUFFIXES, INT8_SUFFIXES
from swarmd.errors import ModelLoadError
from swarmd.model.tensorfile import TensorReader, TensorSpec


@dataclass(frozen=True)
class Int4:
    values: torch.Tensor  # uint8 [N, K], each 0..15
    scale: torch.Tensor  # float32 [N, K / INT4_GROUP]
    zero: torch.Tensor  # float32 [N, K / INT4_GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def rows(self, index: torch.Tensor | slice) -> Int4:
        return Int4(self.values[index], self.scale[index], self.zero[index])


@dataclass(frozen=True)
class Int8:
    values: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def rows(self, index: torch.Tensor | slice) -> Int8:
        return Int8(self.values[index], self.scale[index])


@dataclass(frozen=True)
class Blocks:
    """A GGUF matrix kept in the file's own blocks (Q4_0: 18 bytes per 32 weights, Q8_0:
    34, Q4_K: 144 per 256, Q5_K: 176), for a kernel that reads them as they are
    (`engine/blocks.cpp`). Stands for the same matrix as the `BLOCK_FORMATS` form of its
    values."""

    qtype: str  # a key of BLOCK_FORMATS
    data: torch.Tensor  # uint8 [N, K / 32 * block bytes]
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.data.shape[0]), self.k

    def rows(self, index: torch.Tensor | slice) -> Blocks:
        return Blocks(self.qtype, self.data[index], self.k)


# What each kept block type stands for where its kernel cannot run: Q4_0 and Q4_K are int4
# exactly; Q8_0 and Q5_K become int8 per row (Q5's 32 levels a group kept, not cut to 16).
BLOCK_FORMATS = {"Q4_0": "int4", "Q4_K": "int4", "Q8_0": "int8", "Q5_K": "int8"}

Quantized = Int4 | Int8
Stored = torch.Tensor | Int4 | Int8 | Blocks  # a matrix as files hold it: floats, or quantized


def cat_rows(parts: list[Stored] | tuple[Stored, ...]) -> Stored:
    """Matrices of one format stacked along their rows (N): row chunks, fused q/k/v."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Blocks):
        pb = [p for p in parts if isinstance(p, Blocks)]
        return Blocks(first.qtype, torch.cat([p.data for p in pb]), first.k)
    if isinstance(first, Int4):
        p4 = [p for p in parts if isinstance(p, Int4)]
        return Int4(
            torch.cat([p.values for p in p4]),
            torch.cat([p.scale for p in p4]),
            torch.cat([p.zero for p in p4]),
        )
    if isinstance(first, Int8):
        p8 = [p for p in parts if isinstance(p, Int8)]
        return Int8(torch.cat([p.values for p in p8]), torch.cat([p.scale for p in p8]))
    return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])


_DENSE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DENSE_TAGS = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def int4_fits(n: int, k: int) -> bool:
    """Whether torch's int4 CPU kernel takes an [n, k] matrix (else it is held int8)."""
    return n % 16 == 0 and k % INT4_GROUP == 0


# --- from floats ------------------------------------------------------------------------


ROW_CHUNK = 8192  # rows quantized at a time: a 128k-token table never has a float32 twin


def quantize_int4(weight: torch.Tensor) -> Int4:
    """Asymmetric min/max quantization of each group of 32 (GGUF's Q4_1 rule)."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ModelLoadError(f"int4 needs rows of a multiple of {INT4_GROUP} values, not {k}")
    if n > ROW_CHUNK:
        parts = [quantize_int4(weight[i : i + ROW_CHUNK]) for i in range(0, n, ROW_CHUNK)]
        return cat_rows(parts)  # type: ignore[return-value]
    groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    scale = (high - low) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    zero = low + 8.0 * scale  # w = (q - 8) * scale + zero = q * scale + low
    return Int4(q.to(torch.uint8).reshape(n, k), scale.contiguous(), zero.contiguous())


def quantize_int8(weight: torch.Tensor) -> Int8:
    """Symmetric quantization with one scale per row."""
    if weight.shape[0] > ROW_CHUNK:
        rows = range(0, weight.shape[0], ROW_CHUNK)
        return cat_rows([quantize_int8(weight[i : i + ROW_CHUNK]) for i in rows])  # type: ignore[return-value]
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return Int8(q, scale.contiguous())


def quantize(weight: torch.Tensor, fmt: str) -> Quantized:
    return quantize_int4(weight) if fmt == "int4" else quantize_int8(weight)


def dequantize(weight: Quantized | Blocks) -> torch.Tensor:
    """The float32 matrix a quantized one stands for (callers hold it: one matrix)."""
    if isinstance(weight, Blocks):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[weight.qtype])
        return torch.from_numpy(np.asarray(values, dtype=np.float32))
    if isinstance(weight, Int8):
        return weight.values.float() * weight.scale.unsqueeze(1)
    n, k = weight.shape
    q = weight.values.float().reshape(n, k // INT4_GROUP, INT4_GROUP) - 8.0
    return (q * weight.scale.unsqueeze(-1) + weight.zero.unsqueeze(-1)).reshape(n, k)


def stored_format(stored: Stored) -> str:
    """int4 | int8 | fp32 | bf16 | fp16."""
    if isinstance(stored, Blocks):
        return BLOCK_FORMATS[stored.qtype]
    if isinstance(stored, Int4):
        return "int4"
    if isinstance(stored, Int8):
        return "int8"
    fmt = _DENSE_FORMATS.get(stored.dtype)
    if fmt is None:
        raise ModelLoadError(f"a matrix of dtype {stored.dtype} is not a weight format")
    return fmt


def convert(stored: Stored, fmt: str) -> Stored:
    """A stored matrix in format `fmt`; itself when it already is. An int4 target that
    torch's kernel cannot take (`int4_fits`) becomes int8. Rows go ROW_CHUNK at a time, so
    no whole float32 copy of a large table is ever made."""
    if stored_format(stored) == fmt:
        return stored
    fmt = target_format(fmt, tuple(stored.shape))
    if stored_format(stored) == fmt:
        return stored
    rows = int(stored.shape[0])
    if fmt in DENSE:
        out = torch.empty(tuple(stored.shape), dtype=getattr(torch, DENSE[fmt]))
        for i in range(0, rows, ROW_CHUNK):
            out[i : i + ROW_CHUNK] = _floats(stored, i)
        return out
    return cat_rows([quantize(_floats(stored, i), fmt) for i in range(0, rows, ROW_CHUNK)])


def _floats(stored: Stored, start: int) -> torch.Tensor:
    """Rows start..start+ROW_CHUNK of a stored matrix in float32."""
    span = slice(start, start + ROW_CHUNK)
    if isinstance(stored, torch.Tensor):
        return stored[span].float()
    return dequantize(stored.rows(span))


def target_format(fmt: str, shape: tuple[int, ...]) -> str:
    """What `convert` makes of a matrix of `shape` asked for in `fmt`."""
    if fmt == "int4" and (len(shape) != 2 or not int4_fits(shape[0], shape[1])):
        return "int8"
    return fmt


# --- stored form ------------------------------------------------------------------------
# A quantized tensor `X` is stored as several tensors named X + INT4_SUFFIXES or
# INT8_SUFFIXES (swarmd/dtypes.py).


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 0..15 -> uint8 [N, K/2]: column 2i low, 2i + 1 high."""
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def stored_tensors(name: str, weight: Quantized) -> dict[str, torch.Tensor]:
    """The tensors a file holds for quantized matrix `name`."""
    if isinstance(weight, Int8):
        return {name + INT8_SUFFIXES[0]: weight.values, name + INT8_SUFFIXES[1]: weight.scale}
    values, scale, zero = INT4_SUFFIXES
    return {
        name + values: pack_nibbles(weight.values),
        name + scale: weight.scale,
        name + zero: weight.zero,
    }


def quantized_in(name: str, names: set[str] | dict[str, object]) -> str | None:
    """'int4' or 'int8' when `names` holds matrix `name` in that stored form, else None."""
    if name + INT4_SUFFIXES[0] in names:
        return "int4"
    if name + INT8_SUFFIXES[0] in names:
        return "int8"
    return None


def from_stored(name: str, fmt: str, read: Callable[[str], torch.Tensor]) -> Quantized:
    """Rebuild matrix `name` from its stored tensors; `read(tensor_name)` reads one."""
    if fmt == "int8":
        values, scale = (read(name + s) for s in INT8_SUFFIXES)
        _check(name, values.dtype == torch.int8 and values.dim() == 2, "int8 values")
        _check(name, scale.shape == (values.shape[0],), "one scale per row")
        return Int8(values, scale.float())
    packed, scale, zero = (read(name + s) for s in INT4_SUFFIXES)
    _check(name, packed.dtype == torch.uint8 and packed.dim() == 2, "packed uint8 values")
    n, k = int(packed.shape[0]), int(packed.shape[1]) * 2
    groups = (n, k // INT4_GROUP)
    _check(name, k % INT4_GROUP == 0 and tuple(scale.shape) == groups, "one scale per group")
    _check(name, tuple(zero.shape) == groups, "one zero per group")
    return Int4(unpack_nibbles(packed), scale.float(), zero.float())


def stored_specs(name: str, fmt: str, shape: tuple[int, ...]) -> list[TensorSpec]:
    """The tensors a file holds for tensor `name` of `shape` in format `fmt`."""
    if fmt == "int4":
        n, k = shape
        groups = (n, k // INT4_GROUP)
        values, scale, zero = (name + s for s in INT4_SUFFIXES)
        return [
            TensorSpec(values, "U8", (n, k // 2)),
            TensorSpec(scale, "F32", groups),
            TensorSpec(zero, "F32", groups),
        ]
    if fmt == "int8":
        values, scale = (name + s for s in INT8_SUFFIXES)
        return [TensorSpec(values, "I8", shape), TensorSpec(scale, "F32", shape[:1])]
    return [TensorSpec(name, _DENSE_TAGS[fmt], shape)]


def unblocked(stored: Stored) -> Stored:
    """Kept blocks as the int4 (Q4_0, Q4_K: exactly) or int8 (Q8_0, Q5_K: requantized per
    row) form of their values, for torch's kernels and files; anything else as it is."""
    if not isinstance(stored, Blocks):
        return stored
    if stored.qtype in INT4_EXACT_GGUF:
        return int4_from_gguf(stored.data.numpy(), stored.qtype, stored.k)
    rows = int(stored.data.shape[0])
    return cat_rows(
        [
            quantize_int8(dequantize(stored.rows(slice(i, i + ROW_CHUNK))))
            for i in range(0, rows, ROW_CHUNK)
        ]
    )


def file_tensors(name: str, stored: Stored) -> dict[str, torch.Tensor]:
    """`stored_tensors` for any stored matrix (a dense one is itself)."""
    stored = unblocked(stored)
    if isinstance(stored, torch.Tensor):
        return {name: stored}
    return stored_tensors(name, stored)


class TensorSource(Protocol):
    """A model's tensors by checkpoint name, each read when asked for: safetensors files
    (`StoredTensors`) or a GGUF file in place (`gguf_tensors.GgufTensors`)."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...  # a float tensor (norms, biases)

    def matrix(self, name: str) -> Stored: ...  # a matrix, in its stored form

    def optional(self, name: str) -> torch.Tensor | None: ...

    def close(self) -> None: ...


class StoredTensors:
    """The tensors of a set of safetensors files, by name, each read when asked for; a
    quantized matrix is found and read by its own name."""

    def __init__(self, files: list[Path] | tuple[Path, ...]) -> None:
        self.files = list(files)
        self._readers = [TensorReader(f) for f in files]
        self._where = {name: r for r in self._readers for name in r.names()}

    def __contains__(self, name: str) -> bool:
        return name in self._where or quantized_in(name, self._where) is not None

    def logical_names(self) -> list[str]:
        """Every tensor's name, a quantized matrix once (without its suffixes)."""
        out: list[str] = []
        for name in self._where:
            for suffix in (INT4_SUFFIXES[0], INT8_SUFFIXES[0]):
                if name.endswith(suffix):
                    out.append(name.removesuffix(suffix))
                    break
            else:
                if not name.endswith((*INT4_SUFFIXES[1:], *INT8_SUFFIXES[1:])):
                    out.append(name)
        return out

    def format_and_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The stored format and logical shape of tensor `name` (from headers only)."""
        fmt = quantized_in(name, self._where)
        if fmt == "int4":
            n, half = self._spec(name + INT4_SUFFIXES[0]).shape
            return fmt, (n, half * 2)
        if fmt == "int8":
            return fmt, self._spec(name + INT8_SUFFIXES[0]).shape
        spec = self._spec(name)
        dense = {tag: f for f, tag in _DENSE_TAGS.items()}.get(spec.tag)
        return dense or spec.tag.lower(), spec.shape

    def _spec(self, name: str) -> TensorSpec:
        reader = self._where.get(name)
        if reader is None:
            raise ModelLoadError(f"Tensor '{name}' is missing from the model's files")
        return reader.spec(name)

    def get(self, name: str) -> torch.Tensor:
        reader = self._where.get(name)
        if reader is None:
            raise ModelLoadError(f"Tensor '{name}' is missing from the model's files")
        return reader.get(name)

    def matrix(self, name: str) -> Stored:
        fmt = quantized_in(name, self._where)
        return self.get(name) if fmt is None else from_stored(name, fmt, self.get)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None

    def close(self) -> None:
        for reader in self._readers:
            reader.close()

    def __enter__(self) -> StoredTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ModelLoadError(f"Tensor {name!r} is not a valid quantized matrix ({what})")


# --- from GGUF blocks -------------------------------------------------------------------

INT4_EXACT_GGUF = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_F16 = np.float16


def int4_from_gguf(raw: np.ndarray, qtype: str, k: int) -> Int4:
    """The int4 form of a Q4_0 / Q4_1 / Q4_K tensor, exactly (raw: uint8 [N, row bytes])."""
    n = raw.shape[0]
    if qtype == "Q4_0":
        blocks = raw.reshape(n, k // 32, 18)
        d = blocks[..., :2].copy().view(_F16).astype(np.float32)[..., 0]
        q = _q4_32(blocks[..., 2:])
        scale, zero = d, np.zeros_like(d)
    elif qtype == "Q4_1":
        blocks = raw.reshape(n, k // 32, 20)
        d = blocks[..., :2].copy().view(_F16).astype(np.float32)[..., 0]
        m = blocks[..., 2:4].copy().view(_F16).astype(np.float32)[..., 0]
        q = _q4_32(blocks[..., 4:])
        scale, zero = d, m + np.float32(8.0) * d
    elif qtype == "Q4_K":
        scale, zero, q = _q4_k(raw.reshape(n, k // 256, 144))
    else:
        raise ModelLoadError(f"GGUF type {qtype} is not an int4 block format")
    values = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k)))
    return Int4(
        values, torch.from_numpy(scale.reshape(n, -1)), torch.from_numpy(zero.reshape(n, -1))
    )


def _q4_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: the low nibbles are values 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Superblocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of values."""
    from gguf.quants import Q4_K

    n, supers = blocks.shape[:2]
    flat = blocks.reshape(n * supers, 144)
    d = flat[:, :2].copy().view(_F16).astype(np.float32)  # [B, 1]
    dmin = flat[:, 2:4].copy().view(_F16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(flat[:, 4:16])  # [B, 8] each
    scale = d * sc.astype(np.float32)  # [B, 8]: sub-block j of 32 values
    low = dmin * mins.astype(np.float32)
    # The 128 value bytes are 4 runs of 32: run r holds sub-block 2r in its low nibbles
    # and sub-block 2r + 1 in its high nibbles.
    qs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).astype(np.uint8).reshape(n, supers * 256)
    zero = np.float32(8.0) * scale - low
    return scale.reshape(n, supers * 8), zero.reshape(n, supers * 8), q
