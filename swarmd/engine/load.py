"""Building a `LeanStage` from a model's tensors (safetensors files, or a GGUF file read
in place), by a plain table of checkpoint names.

Each matrix is read in its stored form (a float tensor, or int4 / int8 with their scales:
see `model.quant`), converted to the format the node holds (`held_format`), fused with
its neighbours (q/k/v, gate/up) and packed for the kernels, one tensor at a time: the
stored copy is dropped before the next is read, so loading peaks near the held size.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from swarmd.dtypes import QUANTIZED, head_format, held_format
from swarmd.engine.arch import ArchSpec
from swarmd.engine.linear import Int8Dot, Matrix, Projection, make_matrix
from swarmd.engine.rope import RopeTable
from swarmd.engine.stage import ACT, Embedding, LayerWeights, LeanStage
from swarmd.errors import ModelLoadError
from swarmd.model import quant
from swarmd.model.layers import LayerRange
from swarmd.model.quant import Stored, StoredTensors, TensorSource, convert, stored_format
from swarmd.model.tensorfile import TensorReader

# Our name -> the checkpoint name under model.layers.N. (matrices without ".weight")
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")


def stored_formats(files: Iterable[Path]) -> set[str]:
    """The formats the layer matrices of `files` are stored in (from headers only)."""
    formats: set[str] = set()
    for path in files:
        reader = TensorReader(path)
        for name in reader.names():
            if not name.startswith("model.layers."):
                continue
            if name.endswith(quant.INT4_SUFFIXES[0]):
                formats.add("int4")
            elif name.endswith(quant.INT8_SUFFIXES[0]):
                formats.add("int8")
            elif name.endswith("proj.weight"):
                formats.add(
                    {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(
                        reader.spec(name).tag, "fp32"
                    )
                )
    return formats


def load_lean_stage(
    source: list[Path] | TensorSource,
    spec: ArchSpec,
    layers: LayerRange,
    weights: str,
    dtype: torch.dtype,
) -> LeanStage:
    """The stage for `layers` from `source` (safetensors files, or tensors already open:
    the caller closes those), its matrices held as `weights` (or auto)."""
    dtype_name = str(dtype).removeprefix("torch.")
    tensors = StoredTensors(source) if isinstance(source, list) else source
    try:
        blocks = [
            _layer(tensors, spec, i, weights, dtype, dtype_name)
            for i in range(layers.start, layers.end)
        ]
        embed, head, norm = None, None, None
        if layers.is_first():
            embed = _embedding(tensors, spec, weights, dtype_name)
        if layers.is_last(spec.num_layers):
            norm = _norm(
                _shaped("model.norm.weight", tensors.get("model.norm.weight"), (spec.hidden,)), spec
            )  # type: ignore[arg-type]
            head = _head(tensors, spec, weights, dtype, dtype_name, embed)
    finally:
        if isinstance(source, list):
            tensors.close()
    ropes = {kind: RopeTable(rope, spec.head_dim, ACT) for kind, rope in spec.rope.items()}
    return LeanStage(spec, layers, dtype, blocks, embed, norm, head, ropes)


def _norm(weight: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    # Gemma's (1 + w), folded in once in float32 as transformers computes it.
    return (weight.float() + spec.norm_offset).to(ACT)


def _shaped(name: str, stored: Stored, shape: tuple[int, ...]) -> Stored:
    """The tensor itself if it has the shape the config says; ModelLoadError naming both."""
    if tuple(stored.shape) != shape:
        raise ModelLoadError(
            f"Tensor '{name}' is {list(stored.shape)}, the model's config says {list(shape)}"
        )
    return stored


def _convert(stored: Stored, weights: str, dtype_name: str) -> Stored:
    return convert(stored, held_format(stored_format(stored), weights, dtype_name))


def _layer(
    tensors: TensorSource,
    spec: ArchSpec,
    index: int,
    weights: str,
    dtype: torch.dtype,
    dtype_name: str,
) -> LayerWeights:
    prefix = f"model.layers.{index}."
    hidden, inner = spec.hidden, spec.intermediate
    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    rows = {
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }

    def projection(names: tuple[str, ...], with_bias: bool) -> Projection:
        parts, biases = [], []
        for n in names:
            name = prefix + n + ".weight"
            parts.append(
                _convert(_shaped(name, tensors.matrix(name), rows[n]), weights, dtype_name)
            )
            bias = tensors.optional(prefix + n + ".bias") if with_bias else None
            if bias is not None:
                bias = _shaped(prefix + n + ".bias", bias, rows[n][:1])
            biases.append(bias)
        return Projection(parts, biases, dtype)

    def norm(name: str, size: int = hidden) -> torch.Tensor:
        full = prefix + name + ".weight"
        weight = _shaped(full, tensors.get(full), (size,))
        return _norm(weight, spec)  # type: ignore[arg-type]

    gemma = spec.is_gemma
    block = LayerWeights(
        attn_norm=norm("input_layernorm"),
        qkv=projection(_ATTN, spec.qkv_bias),
        o=projection(("self_attn.o_proj",), spec.o_bias),
        mlp_norm=norm("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"),
        gate_up=projection(_MLP, spec.mlp_bias),
        down=projection(("mlp.down_proj",), spec.mlp_bias),
        kind=spec.layer_types[index],
    )
    if spec.qk_norm:
        block.q_norm = norm("self_attn.q_norm", spec.head_dim)
        block.k_norm = norm("self_attn.k_norm", spec.head_dim)
    if gemma:
        block.post_attn_norm = norm("post_attention_layernorm")
        block.post_mlp_norm = norm("post_feedforward_layernorm")
    return block


def _table(
    tensors: TensorSource, name: str, spec: ArchSpec, weights: str, dtype_name: str
) -> Stored:
    """The embeddings or the head as held: int8 under quantized layers (an int4 table is
    held int8 too: lookups read its rows), else the layers' rule."""
    stored = _shaped(name, tensors.matrix(name), (spec.vocab, spec.hidden))
    target = held_format(stored_format(stored), weights, dtype_name)
    table = convert(stored, head_format(target) if target in QUANTIZED else target)
    return convert(table, "int8") if isinstance(table, quant.Int4) else table


def _embedding(tensors: TensorSource, spec: ArchSpec, weights: str, dtype_name: str) -> Embedding:
    name = "model.embed_tokens.weight"
    mapped = getattr(tensors, "rows", None)
    rows = mapped(name) if mapped is not None else None
    if rows is not None:
        # A GGUF's table stays in the file: a token reads one row, decoded exactly as the
        # file's blocks say, and the table's pages are the kernel's to drop (no copy held).
        _shaped(name, rows, (spec.vocab, spec.hidden))  # type: ignore[arg-type]
        return Embedding(None, None, spec.embed_scale, rows)
    table = _table(tensors, name, spec, weights, dtype_name)
    if isinstance(table, quant.Int8):
        return Embedding(table.values, table.scale, spec.embed_scale)
    if not isinstance(table, torch.Tensor):
        raise ModelLoadError("embedding table of an unknown format")
    return Embedding(table, None, spec.embed_scale)


def _head(
    tensors: TensorSource,
    spec: ArchSpec,
    weights: str,
    dtype: torch.dtype,
    dtype_name: str,
    embed: Embedding | None,
) -> Matrix:
    if embed is not None and spec.tie_embeddings and embed.table is not None:
        # A tied head on a stage that also holds the table: one tensor serves both (a last
        # shard's lm_head.weight is a copy of it).
        if embed.scale is not None:
            head = make_matrix(quant.Int8(embed.table, embed.scale), None, dtype)
            if isinstance(head, Int8Dot):
                embed.share_blocked(head.packed)  # the [V, H] table is freed
            return head
        return make_matrix(embed.table, None, dtype)
    name = "lm_head.weight"
    if name not in tensors:
        if not spec.tie_embeddings:
            raise ModelLoadError("The model has no lm_head.weight and does not tie embeddings")
        name = "model.embed_tokens.weight"
    return make_matrix(_table(tensors, name, spec, weights, dtype_name), None, dtype)
