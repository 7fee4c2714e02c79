"""swarmd's GGUF block kernel (engine/blocks.cpp): Q4_0 and Q8_0 matrices as the file
holds them, against a reference computed here from the same 8-bit activations, and the
same bits for a row alone and in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from swarmd.engine import native
from swarmd.engine.linear import Blocks, make_matrix
from swarmd.model import quant
from tests.gguf_files import random_blocks

# The kernel's own tests need a CPU with AVX2, FMA and F16C (and g++); the last test runs
# everywhere: what a node holds where the kernel cannot run.
needs_kernel = pytest.mark.skipif(
    native.blocks_op() is None, reason="no AVX2/FMA/F16C or no g++ here"
)


def _activations_as_8_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantization of bfloat16 rows: int8 per block of 32 and its scale."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse.unsqueeze(-1))  # half to even, as nearbyint
    return q, scale


def _reference(x: torch.Tensor, raw: np.ndarray, qtype: str) -> torch.Tensor:
    """Each block's integer dot product, scaled by both scales, summed in float64."""
    q, scale = _activations_as_8_bits(x)  # [M, G, 32], [M, G]
    kind = GGMLQuantizationType[qtype]
    n = raw.shape[0]
    values = torch.from_numpy(dequantize(raw, kind)).double().reshape(n, -1, 32)  # d * q
    sums = torch.einsum("mgk,ngk->mng", q.double(), values)
    return (sums * scale.double().unsqueeze(1)).sum(-1)


@needs_kernel
@pytest.mark.parametrize(
    ("qtype", "shape"),
    [
        *((q, shape) for q in ("Q4_0", "Q8_0") for shape in ((64, 96), (160, 256), (48, 1024))),
        *((q, shape) for q in ("Q4_K", "Q5_K") for shape in ((64, 256), (160, 512), (48, 2048))),
    ],
)
def test_block_kernel_matches_integer_sums(qtype: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(shape[0])
    n, k = shape
    raw = random_blocks(qtype, n, k, rng)
    matrix = make_matrix(quant.Blocks(qtype, torch.from_numpy(raw), k), None, torch.bfloat16)
    assert isinstance(matrix, Blocks) and matrix.fmt == quant.BLOCK_FORMATS[qtype]
    x = torch.randn(7, k).to(torch.bfloat16)
    out = matrix(x).double()
    expected = _reference(x, raw, qtype)
    # float32 sums of exact block products, then one bfloat16 rounding
    assert torch.allclose(out, expected, rtol=1e-2, atol=1e-3 * expected.abs().max().item())
    # and against the float matmul of the dequantized weights: the 8-bit activations
    dense = x.float() @ torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype])).T
    assert (out.float() - dense).abs().max() < 0.03 * dense.abs().max()


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(qtype: str, threads: int) -> None:
    rng = np.random.default_rng(1)
    raw = random_blocks(qtype, 256, 512, rng)
    matrix = make_matrix(quant.Blocks(qtype, torch.from_numpy(raw), 512), None, torch.bfloat16)
    x = torch.randn(13, 512).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = matrix(x)
        for m in (1, 2, 3, 5, 8, 13):
            assert torch.equal(matrix(x[:m]), batch[:m])
        assert torch.equal(matrix(x[6:7]), batch[6:7])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_q4_0_bands_hold_the_files_bytes() -> None:
    """Interleaving 4 rows reorders the file's bytes and adds none; a bias still adds."""
    rng = np.random.default_rng(2)
    raw = random_blocks("Q4_0", 64, 128, rng)
    bias = torch.randn(64)
    matrix = make_matrix(quant.Blocks("Q4_0", torch.from_numpy(raw), 128), bias, torch.bfloat16)
    assert isinstance(matrix, Blocks) and matrix.code == native.BAND_CODE
    assert matrix.data.numel() == raw.size
    assert sorted(matrix.data.flatten().tolist()) == sorted(raw.flatten().tolist())
    x = torch.randn(3, 128).to(torch.bfloat16)
    plain = make_matrix(quant.Blocks("Q4_0", torch.from_numpy(raw), 128), None, torch.bfloat16)
    assert torch.allclose(
        matrix(x).float(), plain(x).float() + bias.to(torch.bfloat16).float(), atol=0.05
    )


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K"])
def test_without_the_kernel_blocks_become_torchs_forms(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the block kernel cannot run, Q4_0 and Q4_K are held as int4 (the same values
    exactly) and Q8_0 and Q5_K as int8 per row, on torch's kernels."""
    monkeypatch.setattr(native, "blocks_op", lambda: None)
    raw = random_blocks(qtype, 64, 256, np.random.default_rng(3))
    stored = quant.Blocks(qtype, torch.from_numpy(raw), 256)
    matrix = make_matrix(stored, None, torch.bfloat16)
    assert not isinstance(matrix, Blocks) and matrix.fmt == quant.BLOCK_FORMATS[qtype]
    values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    if qtype in ("Q4_0", "Q4_K"):
        assert torch.equal(quant.dequantize(quant.unblocked(stored)), values)  # type: ignore[arg-type]
    x = torch.randn(2, 256).to(torch.bfloat16)
    dense = x.float() @ values.T
    assert (matrix(x).float() - dense).abs().max() < 0.03 * dense.abs().max()


@needs_kernel
@pytest.mark.parametrize("shape", [(64, 256), (513, 768)])
def test_q6_k_requantizes_to_the_bits_of_the_float_path(shape: tuple[int, int]) -> None:
    """The one-pass Q6_K -> int8 gives what gguf's dequantization and quantize_int8 give."""
    n, k = shape
    raw = random_blocks("Q6_K", n, k, np.random.default_rng(4))
    values, scale = torch.ops.swarmd_blocks.q6_k_to_int8(torch.from_numpy(raw), k)
    floats = np.array(dequantize(raw, GGMLQuantizationType.Q6_K), dtype=np.float32)
    expected = quant.quantize_int8(torch.from_numpy(floats))
    assert torch.equal(values, expected.values) and torch.equal(scale, expected.scale)


@needs_kernel
@pytest.mark.parametrize(
    ("qtype", "n"), [("Q4_0", 64), ("Q4_0", 66), ("Q8_0", 64), ("Q4_K", 64), ("Q5_K", 66)]
)
def test_a_heads_rows_read_back_as_the_files_values(qtype: str, n: int) -> None:
    """What near ties are settled with (engine/ties.py): rows of a held head, banded or
    not, are exactly the file's dequantized rows."""
    k = 256
    raw = random_blocks(qtype, n, k, np.random.default_rng(5))
    matrix = make_matrix(quant.Blocks(qtype, torch.from_numpy(raw), k), None, torch.bfloat16)
    assert isinstance(matrix, Blocks)
    values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    rows = torch.tensor([0, 5, 3, n - 1, 5])
    assert torch.equal(matrix.float_rows(rows), values[rows])
