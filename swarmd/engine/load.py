"""Building a `LeanStage` from safetensors files, by a plain table of checkpoint names.

Each matrix is read in its stored form (a float tensor, or int4 / int8 with their scales:
see `model.quant`), converted to the format the node holds (`held_format`), fused with
its neighbours (q/k/v, gate/up) and packed for the kernels, one tensor at a time: the
stored copy is dropped before the next is read, so loading peaks near the held size.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from swarmd.dtypes import AUTO, DENSE, QUANTIZED, head_format
from swarmd.engine.arch import ArchSpec
from swarmd.engine.linear import Matrix, Projection, make_matrix
from swarmd.engine.rope import RopeTable
from swarmd.engine.stage import ACT, Embedding, LayerWeights, LeanStage
from swarmd.errors import ModelLoadError
from swarmd.model import quant
from swarmd.model.layers import LayerRange
from swarmd.model.quant import Stored, StoredTensors, convert, stored_format
from swarmd.model.tensorfile import TensorReader

DENSE_OF = {compute: fmt for fmt, compute in DENSE.items()}  # "bfloat16" -> "bf16"

# Our name -> the checkpoint name under model.layers.N. (matrices without ".weight")
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")


def held_format(stored: str, weights: str, dtype_name: str) -> str:
    """The format a matrix stored as `stored` is held in, for `--weights` and `--dtype`.

    `auto` keeps quantized matrices as they are and holds dense ones in the compute
    dtype (a float32 checkpoint run with --dtype bfloat16 holds bfloat16 weights).
    """
    if weights != AUTO:
        return weights
    return stored if stored in QUANTIZED else DENSE_OF[dtype_name]


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
    files: list[Path],
    spec: ArchSpec,
    layers: LayerRange,
    weights: str,
    dtype: torch.dtype,
) -> LeanStage:
    """The stage for `layers` from `files`, its matrices held as `weights` (or auto)."""
    dtype_name = str(dtype).removeprefix("torch.")
    tensors = StoredTensors(files)
    try:
        blocks = [
            _layer(tensors, spec, i, weights, dtype, dtype_name)
            for i in range(layers.start, layers.end)
        ]
        embed, head, norm = None, None, None
        if layers.is_first():
            embed = _embedding(tensors, spec, weights, dtype, dtype_name)
        if layers.is_last(spec.num_layers):
            norm = _norm(tensors.get("model.norm.weight"), spec)
            head = _head(tensors, spec, weights, dtype, dtype_name, embed)
    finally:
        tensors.close()
    ropes = {kind: RopeTable(rope, spec.head_dim, ACT) for kind, rope in spec.rope.items()}
    return LeanStage(spec, layers, dtype, blocks, embed, norm, head, ropes)


def _norm(weight: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    # Gemma's (1 + w), folded in once in float32 as transformers computes it.
    return (weight.float() + spec.norm_offset).to(ACT)


def _convert(stored: Stored, weights: str, dtype_name: str) -> Stored:
    return convert(stored, held_format(stored_format(stored), weights, dtype_name))


def _layer(
    tensors: StoredTensors,
    spec: ArchSpec,
    index: int,
    weights: str,
    dtype: torch.dtype,
    dtype_name: str,
) -> LayerWeights:
    prefix = f"model.layers.{index}."

    def projection(names: tuple[str, ...], with_bias: bool) -> Projection:
        parts = [
            _convert(tensors.matrix(prefix + n + ".weight"), weights, dtype_name) for n in names
        ]
        biases = [tensors.optional(prefix + n + ".bias") if with_bias else None for n in names]
        return Projection(parts, biases, dtype)

    def norm(name: str) -> torch.Tensor:
        return _norm(tensors.get(prefix + name + ".weight"), spec)

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
        block.q_norm = norm("self_attn.q_norm")
        block.k_norm = norm("self_attn.k_norm")
    if gemma:
        block.post_attn_norm = norm("post_attention_layernorm")
        block.post_mlp_norm = norm("post_feedforward_layernorm")
    return block


def _table_format(stored: Stored, weights: str, dtype_name: str) -> str:
    """Embeddings and head: int8 under quantized layers, else the layers' rule."""
    target = held_format(stored_format(stored), weights, dtype_name)
    return head_format(target) if target in QUANTIZED else target


def _embedding(
    tensors: StoredTensors, spec: ArchSpec, weights: str, dtype: torch.dtype, dtype_name: str
) -> Embedding:
    stored = tensors.matrix("model.embed_tokens.weight")
    table = convert(stored, _table_format(stored, weights, dtype_name))
    if isinstance(table, quant.Int4):  # lookups read rows: int4 tables are held int8
        table = convert(table, "int8")
    if isinstance(table, quant.Int8):
        return Embedding(table.values, table.scale, spec.embed_scale)
    if not isinstance(table, torch.Tensor):
        raise ModelLoadError("embedding table of an unknown format")
    return Embedding(table, None, spec.embed_scale)


def _head(
    tensors: StoredTensors,
    spec: ArchSpec,
    weights: str,
    dtype: torch.dtype,
    dtype_name: str,
    embed: Embedding | None,
) -> Matrix:
    name = "lm_head.weight"
    if name not in tensors:
        if not spec.tie_embeddings:
            raise ModelLoadError("The model has no lm_head.weight and does not tie embeddings")
        name = "model.embed_tokens.weight"
    if embed is not None and name == "model.embed_tokens.weight":
        # A tied head on a stage that also holds the table: one tensor serves both.
        if embed.scale is not None:
            return make_matrix(quant.Int8(embed.table, embed.scale), None, dtype)
        return make_matrix(embed.table, None, dtype)
    stored = tensors.matrix(name)
    table = convert(stored, _table_format(stored, weights, dtype_name))
    if isinstance(table, quant.Int4):
        table = convert(table, "int8")
    return make_matrix(table, None, dtype)
