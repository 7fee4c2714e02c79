"""Matrices as a stage holds them, and the one call each makes per step.

- `Dense`: a float matrix, `F.linear` (oneDNN); activations cast to its dtype if need be.
- `Int8`: int8 values with a scale per row, `_weight_int8pack_mm`.
- `Int4`: torch's CPU-packed int4 with [K/32, N, 2] scales and zeros,
  `_weight_int4pack_mm_for_cpu`. Both quantized kernels are vectorised only for bfloat16
  activations (float32 takes a scalar path 10-20x slower), hence the default dtype.

`Projection` fuses several matrices that read the same input (q, k and v; gate and up)
into one call per format: one matmul instead of three, outputs split as views.
`make_matrix` turns a stored matrix (a float tensor or `quant.Int4` / `quant.Int8`, already
converted to the format the stage holds) into the kernel's form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from swarmd.dtypes import INT4_GROUP
from swarmd.errors import ModelLoadError
from swarmd.model import quant
from swarmd.model.quant import Stored, stored_format


class Matrix(Protocol):
    out_features: int
    fmt: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [M, K] -> [M, N]


class Dense:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> None:
        self.weight = weight.contiguous()  # [N, K]
        self.bias = bias
        self.fmt = fmt
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


class Int8:
    fmt = "int8"

    def __init__(self, weight: quant.Int8, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.values = weight.values.contiguous()  # int8 [N, K]
        self.scale = weight.scale.to(dtype)  # [N], in the activations' dtype (kernel contract)
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = int(self.values.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.values, self.scale)
        return out if self.bias is None else out.add_(self.bias)


class Int4:
    fmt = "int4"

    def __init__(self, weight: quant.Int4, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        n, k = weight.shape
        if not quant.int4_fits(n, k):
            raise ModelLoadError(f"an int4 matrix must be N % 16 == 0, K % 32 == 0, not {n}x{k}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.values.to(torch.int32), 1
        )  # uint8 [N, K/2] in this CPU's layout
        # [K/32, N, 2]: the kernel computes w = (q - 8) * scale + zero
        self.scale_zero = torch.stack([weight.scale, weight.zero], dim=-1).transpose(0, 1)
        self.scale_zero = self.scale_zero.to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, INT4_GROUP, self.scale_zero
        )
        return out if self.bias is None else out.add_(self.bias)


def make_matrix(stored: Stored, bias: torch.Tensor | None, dtype: torch.dtype) -> Matrix:
    """The held matrix for a stored one (already in its target format)."""
    if isinstance(stored, quant.Int4):
        return Int4(stored, bias, dtype)
    if isinstance(stored, quant.Int8):
        return Int8(stored, bias, dtype)
    return Dense(stored, None if bias is None else bias.to(stored.dtype), stored_format(stored))


class Projection:
    """Matrices over the same input as few calls as their formats allow.

    `__call__(x)` returns one output per matrix, in the order given (views of the fused
    outputs). A Gemma Q4_K_M file holds q and k int4 but v int8: that is two calls.
    """

    def __init__(
        self,
        parts: Sequence[Stored],
        biases: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
    ) -> None:
        self.sizes = [_rows(p) for p in parts]
        # Consecutive parts of one format fuse; the order of outputs is kept.
        self.groups: list[tuple[Matrix, list[int]]] = []
        start = 0
        while start < len(parts):
            end = start + 1
            fmt = stored_format(parts[start])
            while end < len(parts) and stored_format(parts[end]) == fmt:
                end += 1
            chunk = parts[start:end]
            group_bias = biases[start:end]
            bias = None
            if any(b is not None for b in group_bias):
                bias = torch.cat(
                    [
                        b if b is not None else torch.zeros(_rows(p))
                        for p, b in zip(chunk, group_bias, strict=True)
                    ]
                )
            matrix = make_matrix(quant.cat_rows(chunk), bias, dtype)
            self.groups.append((matrix, self.sizes[start:end]))
            start = end

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """One output per matrix; each fused call's output is cast to `out_dtype` once."""
        outs: list[torch.Tensor] = []
        for matrix, sizes in self.groups:
            out = matrix(x)
            if out_dtype is not None and out.dtype != out_dtype:
                out = out.to(out_dtype)
            outs.extend(out.split(sizes, dim=-1) if len(sizes) > 1 else (out,))
        return outs

    def fused(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """The whole output as one [M, sum of N] tensor when every matrix is in one call."""
        if len(self.groups) != 1:
            return None
        out = self.groups[0][0](x)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def single(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a projection of one matrix."""
        return self.groups[0][0](x)

    @property
    def formats(self) -> set[str]:
        return {m.fmt for m, _ in self.groups}


def _rows(stored: Stored) -> int:
    return int(stored.shape[0])
