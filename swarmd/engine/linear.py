"""Matrices as a stage holds them, and the one call each makes per step.

- `Dense`: a float matrix, `F.linear` (oneDNN); activations cast to its dtype if need be.
  Where one row alone would round otherwise than among others (oneDNN's bf16 kernels on
  AVX-512 CPUs), a one-row input runs as two rows (`rows_for_one_kernel`).
- `Int8`: int8 values with a scale per row, `_weight_int8pack_mm`.
- `Int4`: torch's CPU-packed int4 with [K/32, N, 2] scales and zeros,
  `_weight_int4pack_mm_for_cpu`. Both quantized kernels are vectorised only for bfloat16
  activations (float32 takes a scalar path 10-20x slower), hence the default dtype.
- `Int4Dot`, `Int8Dot`: the same matrices for swarmd's own kernels (`native.py`,
  `bf16_dot.cpp`: bfloat16 dot products), taken for bfloat16 activations where they
  loaded. Against torch's, 2 threads: int4 1.35x on one row, 1.8x on eight; the int8 head
  of the embedded model 2.4x on one row, 2.8x on eight.

`Projection` fuses several matrices that read the same input (q, k and v; gate and up)
into one call per format: one matmul instead of three, outputs split as views.
`make_matrix` turns a stored matrix (a float tensor or `quant.Int4` / `quant.Int8`, already
converted to the format the stage holds) into the kernel's form.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from swarmd.dtypes import INT4_GROUP
from swarmd.engine import native
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
        self.min_rows = rows_for_one_kernel(self.weight)
        # [min_rows - 1, K] zeros that fill a shorter input up to min_rows
        self._filler = self.weight.new_zeros(self.min_rows - 1, int(weight.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return self._linear(x)
        return self._linear(x.to(self.weight.dtype)).to(x.dtype)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(x.shape[0])
        if rows >= self.min_rows:
            return F.linear(x, self.weight, self.bias)
        padded = torch.cat((x, self._filler[: self.min_rows - rows]))
        return F.linear(padded, self.weight, self.bias)[:rows]


# ATen runs a bf16 / fp16 matmul of at most this many multiply-adds (M*N*K) in its own
# gemm, and a larger one in oneDNN where the CPU has it (`checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp): two kernels, two roundings.
_ONEDNN_MIN_MACS = 16 * 16 * 16
_PROBE_ROWS = 8
_probed: dict[tuple[int, int, torch.dtype], bool] = {}  # (N, K, dtype) -> rows alike


def rows_for_one_kernel(weight: torch.Tensor) -> int:
    """The fewest rows an input of `weight` needs for each row to round as in any batch.

    oneDNN's bf16 brgemm (AVX-512 CPUs) blocks K otherwise for one row than for several
    once K passes 1024 (measured with avx512_bf16, torch 2.13: 5-100% of the rows off by a
    bf16 rounding); from 2 rows on, every row has the bits it has in M=2 whatever the
    other rows, M (2 to 512) or thread count (1 to 16). So where a probe finds a lone row
    rounding otherwise, it runs as two rows: 2-6% on a mid-size matmul (4 us), 5-8% faster
    on large ones, no change measured on a decode step. Padding every matrix instead
    would cost 3% a step (the tied head's M=1 kernel is the faster one). ATen's own gemm
    (AVX2 CPUs) is alike for every M, MKL's float32 for none: both left as they are.
    """
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return 1
    n, k = (int(size) for size in weight.shape)
    if n * k <= _ONEDNN_MIN_MACS:
        # One row in ATen's gemm, more in oneDNN: the rows that reach oneDNN for any M.
        # Only toy matrices are this small; a probe misses ATen's rarer differences.
        return _ONEDNN_MIN_MACS // max(1, n * k) + 1
    key = (n, k, weight.dtype)
    if key not in _probed:
        _probed[key] = _one_row_rounds_alike(weight)
    return 1 if _probed[key] else 2


@torch.inference_mode()
def _one_row_rounds_alike(weight: torch.Tensor) -> bool:
    """Whether rows of a matmul by `weight` run alone give the bits they give in a batch.

    The kernel's blocking follows the shape, not the values, so the weight itself serves.
    Random rows show another order of the adds only now and then under bf16 rounding, so
    each probe row puts +big and -big on two equal weights of one output, far apart in K:
    the small terms added between them lose bits that depend on how K is blocked, and the
    cancelled result shows them (measured: 13-16 of 16 such rows differ where random rows
    differ 0-16%)."""
    n, k = (int(size) for size in weight.shape)
    x = torch.randn(_PROBE_ROWS, k, generator=torch.Generator().manual_seed(0))
    quarter = max(1, k // 4)
    for r in range(_PROBE_ROWS):
        w = weight[r * n // _PROBE_ROWS].float()  # [K]
        first, last = w[:quarter], w[k - quarter :]
        usable = first.abs() >= w.abs().mean() / 2  # not tiny: +-big stays finite
        pairs = (torch.isin(first, last) & usable).nonzero()
        if len(pairs) == 0:
            continue  # no equal pair: a plain random row
        p = int(pairs[0])
        q = k - quarter + int((last == first[p]).nonzero()[-1])
        big = torch.exp2(torch.round(torch.log2(2.0**20 * w.abs().mean() / w[p].abs())))
        x[r, p], x[r, q] = big, -big
    x = x.to(weight.dtype)
    batch = F.linear(x, weight)
    return all(
        torch.equal(F.linear(x[r : r + 1], weight), batch[r : r + 1]) for r in range(_PROBE_ROWS)
    )


class _Quantized(ABC):
    """A quantized kernel's product, then the bias (in the activations' dtype) if any."""

    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x)
        return out if self.bias is None else out.add_(self.bias)

    @abstractmethod
    def _product(self, x: torch.Tensor) -> torch.Tensor: ...  # [M, K] -> [M, N]


class Int8(_Quantized):
    fmt = "int8"

    def __init__(self, weight: quant.Int8, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.values = weight.values.contiguous()  # int8 [N, K]
        self.scale = weight.scale.to(dtype)  # [N], in the activations' dtype (kernel contract)
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = int(self.values.shape[0])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.values, self.scale)


class Int4(_Quantized):
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

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, INT4_GROUP, self.scale_zero
        )


class Int4Dot(_Quantized):
    fmt = "int4"

    def __init__(self, weight: quant.Int4, bias: torch.Tensor | None, op: native.Ops) -> None:
        n, k = weight.shape
        if not quant.int4_fits(n, k):
            raise ModelLoadError(f"an int4 matrix must be N % 16 == 0, K % 32 == 0, not {n}x{k}")
        self.packed = native.block_int4(weight.values)  # uint8 [N/16, K/2, 16]
        self.scale = weight.scale.float().T.contiguous()  # [K/32, N], float32 (not rounded)
        self.zero = weight.zero.float().T.contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.out_features = n
        self._op = op.int4

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.scale, self.zero)


class Int8Dot(_Quantized):
    fmt = "int8"

    def __init__(self, weight: quant.Int8, bias: torch.Tensor | None, op: native.Ops) -> None:
        n, k = weight.shape
        if not native.int8_fits(n, k):
            raise ModelLoadError(f"an int8 matrix must be N % 16 == 0, K % 2 == 0, not {n}x{k}")
        self.packed = native.block_int8(weight.values)  # int8 [N/16, K/2, 16, 2]
        self.scale = weight.scale.float().contiguous()  # [N], float32 (not rounded)
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.out_features = n
        self._op = op.int8

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed, self.scale)


class Blocks(_Quantized):
    """A GGUF Q4_0 / Q8_0 / Q4_K / Q5_K matrix in the file's own blocks, `blocks.cpp`'s
    kernel: held in the file's bytes (Q4_0 and Q4_K: 0.5625 bytes a weight, where torch's
    int4 form takes 0.625; Q5_K: 0.6875, where int8 takes 1.0)."""

    def __init__(
        self, weight: quant.Blocks, bias: torch.Tensor | None, op: Callable[..., torch.Tensor]
    ) -> None:
        self.fmt = quant.BLOCK_FORMATS[weight.qtype]
        self.qtype = weight.qtype
        self.data = weight.data.contiguous()  # uint8 [N, K / 32 * block bytes]
        self.code = native.BLOCK_TYPES[weight.qtype]
        n = int(self.data.shape[0])
        if weight.qtype == "Q4_0" and n % native.BAND_ROWS == 0:
            # the same bytes, 4 rows interleaved: 1.4-1.6x the per-row kernel's speed
            self.data, self.code = native.band_q4_0(self.data), native.BAND_CODE
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.out_features = int(self.data.shape[0])
        self._op = op

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.data, self.code)

    def float_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Weight rows `rows` [C] as float32 [C, K], exactly the blocks' values (d * q)."""
        if self.code == native.BAND_CODE:  # 4 rows interleaved: band, then row in it
            count, which = len(rows), torch.arange(len(rows))
            bands = self.data[rows // native.BAND_ROWS].view(count, -1, 72)
            groups, j = bands.shape[1], rows % native.BAND_ROWS
            d = bands[..., :8].reshape(count, groups, native.BAND_ROWS, 2)[which, :, j]
            scale = d.contiguous().view(torch.float16).float()  # [C, G, 1]
            nibbles = bands[..., 8:].reshape(count, groups, native.BAND_ROWS, 16)[which, :, j]
        elif self.qtype in ("Q4_K", "Q5_K"):  # super-blocks of 256: gguf's own arithmetic
            return quant.dequantize(quant.Blocks(self.qtype, self.data[rows], 0))
        else:
            width = 18 if self.code == native.BLOCK_TYPES["Q4_0"] else 34
            blocks = self.data[rows].view(len(rows), -1, width)
            scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [C, G, 1]
            if width == 34:
                values = blocks[..., 2:].contiguous().view(torch.int8).float()
                return (scale * values).reshape(len(rows), -1)
            nibbles = blocks[..., 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float() - 8.0  # [C, G, 32]
        return (scale * q).reshape(len(rows), -1)


def make_matrix(stored: Stored, bias: torch.Tensor | None, dtype: torch.dtype) -> Matrix:
    """The held matrix for a stored one (already in its target format)."""
    if isinstance(stored, quant.Blocks):
        op = native.blocks_op() if dtype == torch.bfloat16 else None
        if op is not None:
            return Blocks(stored, bias, op)
        stored = quant.unblocked(stored)  # torch's (or swarmd's bf16-dot) kernels serve
    ops = native.ops() if dtype == torch.bfloat16 else None
    if isinstance(stored, quant.Int4):
        # a held int4 matrix always blocks (quant.int4_fits: torch's rule is the same)
        return Int4(stored, bias, dtype) if ops is None else Int4Dot(stored, bias, ops)
    if isinstance(stored, quant.Int8):
        if ops is None or not native.int8_fits(*stored.shape):
            return Int8(stored, bias, dtype)
        return Int8Dot(stored, bias, ops)
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
            kind = _kind(parts[start])
            while end < len(parts) and _kind(parts[end]) == kind:
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

    @property
    def kernels(self) -> set[str]:
        """Whose kernels its quantized matrices run: "swarmd" and/or "torch"."""
        return {kind for m, _ in self.groups if (kind := quantized_kernel(m))}


def _kind(stored: Stored) -> tuple[str, str]:
    """What can share one fused call: the format, and the kept block type if any."""
    return stored_format(stored), stored.qtype if isinstance(stored, quant.Blocks) else ""


def quantized_kernel(matrix: Matrix) -> str | None:
    """ "swarmd" or "torch" for a quantized matrix; None for a float one."""
    if isinstance(matrix, Int4Dot | Int8Dot | Blocks):
        return "swarmd"
    return "torch" if isinstance(matrix, Int4 | Int8) else None


def _rows(stored: Stored) -> int:
    return int(stored.shape[0])
