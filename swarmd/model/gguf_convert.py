"""A GGUF file as a folder swarmd loads: config, tokenizer and one safetensors file of
weights in the chosen format, written once into the user's cache.

Weights keep what the file is where that is exact: Q4_0, Q4_1 and Q4_K blocks become int4
group-32 matrices bit for bit (`quant.int4_from_gguf`). Other types are dequantized with
gguf's own reader and requantized once: Q5_x, Q6_K and Q8_0 to int8 per row (the int8
kernel has one scale per row, so a block format's scales do not carry over; Q5's 32
levels a group are kept, where int4 would cut them to 16). F16 and
BF16 become bf16, F32 stays fp32. `--weights X` converts every layer matrix to X instead.
The embeddings and the LM head are int8 whenever the layers are quantized (measured: see
`head_format`), else the dense format.

Tensors are read, converted and written one at a time: a 4 GB GGUF never becomes a 28 GB
float32 copy in memory. Names follow the Hugging Face checkpoints (`model.layers.N...`),
with llama's q/k rows un-permuted and Gemma's norms stored as w (GGUF stores 1 + w), as
transformers does, so the fp32 folder is bit-equal to transformers' own GGUF loading.
Config and tokenizer come from transformers' GGUF support (once, at conversion).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from swarmd.dtypes import AUTO, QUANTIZED, WEIGHT_FORMATS, head_format, weights_label
from swarmd.errors import ModelLoadError
from swarmd.model import quant
from swarmd.model.gguf_index import GgufEntry, entries_of
from swarmd.model.tensorfile import TensorSpec, TensorWriter

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
FORMAT_KEY = "swarmd.weights"  # safetensors metadata: the folder's weights label

# GGUF general.architecture -> the model types transformers reads it as (llama.cpp writes
# Mistral models as "llama"; transformers tells them apart by name).
ARCHITECTURES = {
    "llama": ("llama", "mistral"),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "gemma3": ("gemma3_text",),
}
# What each GGUF tensor type is held as under `--weights auto`.
AUTO_FORMATS = {
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q5_0": "int8",
    "Q5_1": "int8",
    "Q5_K": "int8",
    "Q6_K": "int8",
    "Q8_0": "int8",
    "F16": "bf16",
    "BF16": "bf16",
    "F32": "fp32",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# The norm before the MLP: Llama calls it post_attention_layernorm, Gemma 3 has both.
_FFN_NORM = {"gemma3": "pre_feedforward_layernorm.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_ROW_CHUNK = 16384  # rows dequantized at a time (a 262k-token embedding stays small)


@dataclass(frozen=True)
class Plan:
    """How one GGUF tensor is held: its checkpoint name, format and fix-ups."""

    gguf_name: str
    name: str  # the Hugging Face checkpoint name
    qtype: str  # the GGUF tensor type, e.g. "Q4_1"
    shape: tuple[int, ...]  # [N, K] or [N] (GGUF lists dims the other way round)
    fmt: str  # int4 | int8 | bf16 | fp16 | fp32 (1-D tensors: always fp32)
    permute_heads: int  # > 0: un-permute q/k rows over this many heads (llama)
    minus_one: bool  # Gemma norms: GGUF stores 1 + w

    def specs(self) -> list[TensorSpec]:
        return quant.stored_specs(self.name, self.fmt, self.shape)


def gguf_architecture(path: Path, reader: GGUFReader) -> str:
    """The file's general.architecture, if swarmd runs it; ModelLoadError otherwise."""
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else "?"
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: the GGUF architecture '{arch}' is not supported; swarmd runs "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def write_converted(gguf_path: Path, out: Path, weights: str) -> str:
    """Convert `gguf_path` into folder `out` (which exists and is empty); returns the
    weights label of what was written."""
    if weights != AUTO and weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"weights '{weights}' is not auto or one of {WEIGHT_FORMATS}")
    # Reading a GGUF's metadata is slow (28 s for Gemma 3's 262k-token vocabulary): once.
    reader = open_gguf(gguf_path)
    arch = gguf_architecture(gguf_path, reader)
    entries = entries_of(reader)
    check_tensor_types(entries)  # refused before the slow config and tokenizer parse
    config = write_config_and_tokenizer(gguf_path, out, arch, reader)
    plans = plan(entries, config, arch, weights)
    label = weights_label({p.fmt for p in plans if is_layer_matrix(p)})
    specs = [spec for p in plans for spec in p.specs()]
    by_name = {t.name: t for t in reader.tensors}
    with TensorWriter(out / WEIGHTS_FILE, specs, {FORMAT_KEY: label}) as writer:
        for p in plans:
            for name, tensor in _convert(p, by_name[p.gguf_name].data).items():
                writer.write(name, tensor)
    return label


def check_tensor_types(entries: list[GgufEntry]) -> None:
    for entry in entries:
        if entry.qtype not in AUTO_FORMATS:
            raise ModelLoadError(
                f"GGUF tensor '{entry.name}' is {entry.qtype}, which swarmd does "
                f"not run (it runs {', '.join(AUTO_FORMATS)})"
            )


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the GGUF file {path}: {exc}") from exc


def is_layer_matrix(plan: Plan) -> bool:
    return len(plan.shape) == 2 and plan.name.startswith("model.layers.")


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None:
        return None
    index, rest = match.groups()
    if rest == "ffn_norm.weight":
        suffix = _FFN_NORM.get(model_type.removesuffix("_text"), "post_attention_layernorm.weight")
    else:
        suffix = _LAYER_NAMES.get(rest)  # type: ignore[assignment]
    return f"model.layers.{index}.{suffix}" if suffix else None


def plan(
    entries: list[GgufEntry], config: dict[str, object], arch: str, weights: str
) -> list[Plan]:
    """Each tensor's plan under `weights` (auto: what the file is, Q4 blocks int4)."""
    model_type = str(config["model_type"])
    family = model_type.removesuffix("_text")
    heads = int(config["num_attention_heads"])  # type: ignore[call-overload]
    kv_heads = int(config.get("num_key_value_heads") or heads)  # type: ignore[call-overload]
    quantized_layers = weights in QUANTIZED or (
        weights == AUTO
        and any(
            AUTO_FORMATS.get(t.qtype) in QUANTIZED for t in entries if t.name.startswith("blk.")
        )
    )
    plans = []
    for tensor in entries:
        qtype = tensor.qtype
        if tensor.name == "rope_freqs.weight":
            continue  # read into the config (rope_freq_factors) by write_config_and_tokenizer
        name = _hf_name(tensor.name, model_type)
        if name is None:
            raise ModelLoadError(f"GGUF tensor '{tensor.name}' has no place in a {family} model")
        shape = tensor.shape
        if len(shape) == 1:
            fmt = "fp32"
        elif not name.startswith("model.layers."):  # embeddings, untied head
            if quantized_layers:
                fmt = head_format("int4")
            else:
                fmt = AUTO_FORMATS[qtype] if weights == AUTO else weights
        else:
            fmt = AUTO_FORMATS[qtype] if weights == AUTO else weights
            if fmt == "int4" and not quant.int4_fits(*shape):
                fmt = "int8"  # torch's int4 kernel needs N % 16 == 0 and K % 32 == 0
        permute = 0
        # llama.cpp permutes q/k rows of the GGUF "llama" architecture (Mistral included).
        if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            permute = heads
        elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            permute = kv_heads
        minus_one = family == "gemma3" and "norm.weight" in tensor.name
        plans.append(Plan(tensor.name, name, qtype, shape, fmt, permute, minus_one))
    return plans


def _convert(plan: Plan, data: np.ndarray) -> dict[str, torch.Tensor]:
    """The stored tensors of one GGUF tensor in its planned format."""
    return quant.file_tensors(plan.name, stored_matrix(plan, data))


# Block types a node keeps as the file holds them where the block kernel runs: Q4_0 (10 %
# fewer bytes than torch's int4 form, and faster), Q4_K (the same values as int4 in 10 %
# fewer bytes) and Q5_K (its own precision in 0.69 bytes a weight, where int8 takes 1.0).
# The kernel also reads Q8_0 (tested), but an int8 row form holds Q8_0 in fewer bytes and
# its speed against swarmd's AVX-512 int8 kernel is not measured: int8 still.
KEPT_BLOCKS = frozenset({"Q4_0", "Q4_K", "Q5_K"})


def stored_matrix(plan: Plan, data: np.ndarray, keep_blocks: bool = False) -> quant.Stored:
    """One GGUF tensor (`data`: its bytes or values as gguf's reader shapes them) in its
    planned format: Q4 blocks as int4 exactly, others requantized, floats as floats; with
    `keep_blocks`, Q4_0 matrices planned as int4 stay the file's blocks (`KEPT_BLOCKS`)."""
    order = _unpermute_index(plan.shape[0], plan.permute_heads) if plan.permute_heads else None
    if (
        keep_blocks
        and len(plan.shape) == 2
        and plan.qtype in KEPT_BLOCKS
        and plan.fmt == quant.BLOCK_FORMATS[plan.qtype]
    ):
        blocks = quant.Blocks(plan.qtype, torch.from_numpy(np.array(data)), plan.shape[1])
        return blocks if order is None else blocks.rows(order)
    if plan.fmt == "int4" and plan.qtype in quant.INT4_EXACT_GGUF:
        weight = quant.int4_from_gguf(np.asarray(data), plan.qtype, plan.shape[1])
        return weight if order is None else weight.rows(order)
    if plan.fmt == "int8" and plan.qtype == "Q6_K" and (fast := _q6_k_to_int8()) is not None:
        values, scale = fast(_read_only_tensor(data), plan.shape[1])
        weight = quant.Int8(values, scale)
        return weight if order is None else weight.rows(order)
    if plan.fmt in QUANTIZED:
        parts = [
            quant.quantize(_floats(plan, data[i : i + _ROW_CHUNK]), plan.fmt)
            for i in range(0, plan.shape[0], _ROW_CHUNK)
        ]
        weight = quant.cat_rows(parts)
        return weight if order is None else weight.rows(order)  # type: ignore[union-attr]
    dense = _floats(plan, data)
    if order is not None:
        dense = dense[order]
    if plan.minus_one:
        dense = dense - 1.0
    return dense.to(_DENSE_TORCH[plan.fmt]).contiguous()


def _read_only_tensor(data: np.ndarray) -> torch.Tensor:
    """A tensor over the file's mapped bytes without a copy, for an op that only reads
    them (torch warns that it could write to a read-only array: it does not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(data))


def _q6_k_to_int8() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """swarmd's one-pass Q6_K -> int8 (engine/blocks.cpp), where the engine loaded it: the
    same bits as gguf's dequantization and `quant.quantize_int8` (tested), 5x faster."""
    try:
        return torch.ops.swarmd_blocks.q6_k_to_int8  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


_DENSE_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _floats(plan: Plan, data: np.ndarray) -> torch.Tensor:
    values = dequantize(np.asarray(data), GGMLQuantizationType[plan.qtype])
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is read-only


def _unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse permute)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def write_config_and_tokenizer(
    gguf_path: Path, out: Path, arch: str, reader: GGUFReader
) -> dict[str, object]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        config = AutoConfig.for_model(**parsed["config"])
        # Given the config, AutoTokenizer does not parse the whole file a second time.
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"Cannot read the GGUF file {gguf_path}: {exc}") from exc
    if config.model_type not in ARCHITECTURES[arch]:
        raise ModelLoadError(
            f"{gguf_path.name}: a '{arch}' file read as {config.model_type}, which swarmd "
            "does not run"
        )
    factors = _rope_freq_factors(reader)
    if factors is not None:
        config.rope_freq_factors = factors  # Llama 3's rope scaling, as llama.cpp stores it
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    generation = {
        key: getattr(config, key)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(config, key, None) is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    return json.loads((out / "config.json").read_text())  # type: ignore[no-any-return]


def _rope_freq_factors(reader: GGUFReader) -> list[float] | None:
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return [float(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    return None
