"""Random-weight GGUF files of Llama shapes, any mix of block types, written at test or
benchmark time (tests/unit/test_gguf_tensors.py, bench/big_model.py).

Blocks are random bytes with their scales set so each matrix's weights have a standard
deviation of about `1 / sqrt(K)` (activations stay finite through many layers); no float
weights are made and quantized, so an 8B file is written at disk speed. The tokenizer,
its chat template and special ids come from the embedded model's GGUF; a `vocab` larger
than its 49,152 tokens is padded with unused tokens (Llama 3's 128,256, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

# Where each block type keeps its fp16 scale (d) and, for the asymmetric ones, the fp16
# minimum (m / dmin), in bytes from the block's start; and how a centred block sets m.
_D_AT = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}
_MIN_AT = {"Q4_1": (2, -8.0), "Q5_1": (2, -16.0), "Q4_K": (2, 7.5), "Q5_K": (2, 15.5)}


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 500000.0


SHAPES = {
    "tiny": LlamaShape(4, 256, 512, 4, 2),
    "1b": LlamaShape(16, 2048, 8192, 32, 8, 128256),
    "3b": LlamaShape(28, 3072, 8192, 24, 8, 128256),
    "8b": LlamaShape(32, 4096, 14336, 32, 8, 128256),
}


def embedded_gguf() -> Path:
    from swarmd.model.source import embedded_gguf_path

    return embedded_gguf_path()


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random `qtype` blocks, weights of std ~ 1/sqrt(cols)."""
    kind = GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16"):
        dtype = np.float32 if qtype == "F32" else np.float16
        values = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        return values.astype(dtype).view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    _set_scales(raw, qtype, 1.0)
    probe = dequantize(raw[:1].reshape(1, -1), kind)  # the spread of d = 1
    spread = float(np.std(probe)) or 1.0
    _set_scales(raw, qtype, 1.0 / (spread * np.sqrt(cols)))
    return raw.reshape(rows, -1)


def _set_scales(raw: np.ndarray, qtype: str, d: float) -> None:
    at = _D_AT[qtype]
    raw[..., at : at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if qtype in _MIN_AT:
        where, times = _MIN_AT[qtype]
        raw[..., where : where + 2] = np.frombuffer(np.float16(d * times).tobytes(), np.uint8)


def write_llama_gguf(
    path: Path,
    shape: LlamaShape,
    types: dict[str, str] | None = None,
    default: str = "Q4_0",
    seed: int = 0,
    silence: tuple[int, ...] = (),
) -> Path:
    """A Llama GGUF of `shape`, each matrix of type `types[suffix]` (e.g. "ffn_down.weight",
    "token_embd.weight", "output.weight") or `default`; norms F32. The head's rows of the
    ids in `silence` are zero (a random model then never ends a reply early on them)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    _metadata(writer, shape)
    tensors = list(_tensors(shape, types, default))
    if "output.weight" not in types and default == "tied":
        tensors = [t for t in tensors if t[0] != "output.weight"]
    for name, qtype, (rows, cols) in tensors:
        if cols == 0:
            writer.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
            continue
        kind = GGMLQuantizationType[qtype]
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = rows * cols // block * size
        writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, qtype, (rows, cols) in tensors:
        if cols == 0:  # a norm: ones
            data = np.ones(rows, dtype=np.float32)
        else:
            data = random_blocks(qtype, rows, cols, rng)
            if name == "output.weight" and silence:
                data[list(silence)] = 0
        writer.write_tensor_data(data)
    writer.close()
    return path


def _tensors(shape: LlamaShape, types: dict[str, str], default: str):  # type: ignore[no-untyped-def]
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def kind(suffix: str) -> str:
        return types.get(suffix, default if default != "tied" else "Q4_0")

    yield "token_embd.weight", kind("token_embd.weight"), (shape.vocab, shape.hidden)
    for i in range(shape.layers):
        for suffix, dims in (
            ("attn_norm.weight", (shape.hidden, 0)),
            ("attn_q.weight", (shape.hidden, shape.hidden)),
            ("attn_k.weight", (kv, shape.hidden)),
            ("attn_v.weight", (kv, shape.hidden)),
            ("attn_output.weight", (shape.hidden, shape.hidden)),
            ("ffn_norm.weight", (shape.hidden, 0)),
            ("ffn_gate.weight", (shape.ffn, shape.hidden)),
            ("ffn_up.weight", (shape.ffn, shape.hidden)),
            ("ffn_down.weight", (shape.hidden, shape.ffn)),
        ):
            yield f"blk.{i}.{suffix}", "F32" if dims[1] == 0 else kind(suffix), dims
    yield "output_norm.weight", "F32", (shape.hidden, 0)
    yield "output.weight", kind("output.weight"), (shape.vocab, shape.hidden)


def _metadata(writer: GGUFWriter, shape: LlamaShape) -> None:
    writer.add_name("random llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_vocab_size(shape.vocab)
    reader = GGUFReader(str(embedded_gguf()))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            extra = shape.vocab - len(value)
            if key == "tokenizer.ggml.tokens":
                value = [*value, *(f"<|unused_{i}|>" for i in range(extra))]
            else:
                value = [*value, *([1] * extra)]
            value = value[: shape.vocab]
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
