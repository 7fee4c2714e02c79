"""int4 and int8 matrices: GGUF blocks taken exactly, requantization, the stored form, the
kernels' packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from swarmd.dtypes import INT4_GROUP
from swarmd.engine.linear import Int4 as HeldInt4
from swarmd.engine.linear import Int8 as HeldInt8
from swarmd.errors import ModelLoadError
from swarmd.model import quant

ROWS, COLS = 48, 512  # K a multiple of 256 (Q4_K superblocks), N of 16 (the int4 kernel)


def _weights(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of different scales, as real layers have, and a few outliers.
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * rng.uniform(0.01, 0.5, (ROWS, 1))
    w[rng.integers(0, ROWS, 5), rng.integers(0, COLS, 5)] *= 20
    return w.astype(np.float32)


def _q4_k_blocks(seed: int) -> np.ndarray:
    """Random Q4_K rows: f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    values per superblock (gguf-py can read Q4_K but not write it)."""
    rng = np.random.default_rng(seed)
    supers = COLS // 256
    d = (rng.uniform(0.001, 0.05, (ROWS, supers, 1))).astype(np.float16).view(np.uint8)
    dmin = (rng.uniform(0.001, 0.05, (ROWS, supers, 1))).astype(np.float16).view(np.uint8)
    scales = rng.integers(0, 256, (ROWS, supers, 12), dtype=np.uint8)
    values = rng.integers(0, 256, (ROWS, supers, 128), dtype=np.uint8)
    blocks = np.concatenate([d, dmin, scales, values], axis=-1)
    return blocks.reshape(ROWS, supers * 144)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("seed", range(4))
def test_q4_0_and_q4_1_blocks_become_int4_exactly(qtype: str, seed: int) -> None:
    kind = GGMLQuantizationType[qtype]
    raw = gguf_quantize(_weights(seed), kind)  # uint8 [N, row bytes]
    weight = quant.int4_from_gguf(raw, qtype, COLS)
    expected = torch.from_numpy(gguf_dequantize(raw, kind))
    assert weight.shape == (ROWS, COLS)
    assert int(weight.values.max()) <= 15
    assert torch.equal(quant.dequantize(weight), expected)


@pytest.mark.parametrize("seed", range(4))
def test_q4_k_blocks_become_int4_exactly(seed: int) -> None:
    raw = _q4_k_blocks(seed)
    weight = quant.int4_from_gguf(raw, "Q4_K", COLS)
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.equal(quant.dequantize(weight), expected)


def test_other_block_types_are_not_taken_as_int4() -> None:
    raw = gguf_quantize(_weights(0), GGMLQuantizationType.Q8_0)
    with pytest.raises(ModelLoadError, match="Q8_0"):
        quant.int4_from_gguf(raw, "Q8_0", COLS)


def test_the_cpu_packed_kernel_computes_with_the_same_matrix() -> None:
    """Packing for torch's kernel loses nothing: fed the identity in float32 (the
    kernel's scalar path computes (q - 8) * scale + zero in float32), it returns W^T."""
    raw = _q4_k_blocks(7)
    weight = quant.int4_from_gguf(raw, "Q4_K", COLS)
    held = HeldInt4(weight, None, torch.float32)
    out = held(torch.eye(COLS))  # [K, N] = W^T
    torch.testing.assert_close(out.t(), quant.dequantize(weight), rtol=0, atol=1e-6)


def test_int4_kernel_with_bfloat16_activations_is_close_to_the_float_matmul() -> None:
    raw = gguf_quantize(_weights(3), GGMLQuantizationType.Q4_1)
    weight = quant.int4_from_gguf(raw, "Q4_1", COLS)
    x = torch.randn(3, COLS)
    expected = x @ quant.dequantize(weight).t()
    got = HeldInt4(weight, None, torch.bfloat16)(x.bfloat16()).float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("seed", range(3))
def test_requantized_int4_stays_within_half_a_step(seed: int) -> None:
    w = torch.from_numpy(_weights(seed))
    weight = quant.quantize_int4(w)
    step = weight.scale.repeat_interleave(INT4_GROUP, dim=1)
    error = (quant.dequantize(weight) - w).abs()
    assert bool((error <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("seed", range(3))
def test_int8_per_row_stays_within_half_a_step_and_its_kernel_agrees(seed: int) -> None:
    w = torch.from_numpy(_weights(seed))
    weight = quant.quantize_int8(w)
    error = (quant.dequantize(weight) - w).abs()
    assert bool((error <= weight.scale[:, None] / 2 + 1e-6).all())
    x = torch.randn(2, COLS)
    expected = x @ quant.dequantize(weight).t()
    got = HeldInt8(weight, None, torch.float32)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_a_constant_group_quantizes_to_its_value() -> None:
    w = torch.full((16, 64), 0.25)
    assert torch.equal(quant.dequantize(quant.quantize_int4(w)), w)
    assert torch.equal(
        quant.dequantize(quant.quantize_int8(torch.zeros(16, 64))), torch.zeros(16, 64)
    )


def test_the_stored_form_round_trips() -> None:
    w = torch.from_numpy(_weights(1))
    for weight in (quant.quantize_int4(w), quant.quantize_int8(w)):
        stored = quant.stored_tensors("m.weight", weight)
        fmt = quant.quantized_in("m.weight", stored)
        back = quant.from_stored("m.weight", fmt or "", stored.__getitem__)
        assert torch.equal(quant.dequantize(back), quant.dequantize(weight))
        specs = quant.stored_specs("m.weight", fmt or "", (ROWS, COLS))
        assert {s.name: s.shape for s in specs} == {k: tuple(v.shape) for k, v in stored.items()}


def test_nibbles_pack_two_columns_a_byte_low_first() -> None:
    values = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = quant.pack_nibbles(values)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(quant.unpack_nibbles(packed), values)


def test_a_stored_int4_matrix_with_a_wrong_shape_is_refused() -> None:
    stored = quant.stored_tensors("m.weight", quant.quantize_int4(torch.randn(16, 64)))
    stored["m.weight.int4_scale"] = torch.zeros(16, 3)
    with pytest.raises(ModelLoadError, match="one scale per group"):
        quant.from_stored("m.weight", "int4", stored.__getitem__)


@pytest.mark.parametrize(
    ("source", "target"),
    [("fp32", "int4"), ("fp32", "int8"), ("int4", "int8"), ("int8", "bf16"), ("int4", "fp32")],
)
def test_convert_between_formats(source: str, target: str) -> None:
    w = torch.from_numpy(_weights(2))
    stored = quant.convert(w, source)
    out = quant.convert(stored, target)
    assert quant.stored_format(out) == target
    assert (
        quant.dequantize(out) if not isinstance(out, torch.Tensor) else out.float()
    ).shape == w.shape


def test_int4_falls_back_to_int8_where_the_kernel_cannot_take_the_shape() -> None:
    w = torch.randn(10, 64)  # 10 rows: not a multiple of 16
    assert quant.target_format("int4", (10, 64)) == "int8"
    assert quant.stored_format(quant.convert(w, "int4")) == "int8"
