"""`StageModule`: decoder layers [start, end) of a model, runnable on their own.

Layers are renumbered from 0 so a stage-local cache indexes from 0 (reusing the full
model's layer indices with a short cache builds the mask from the wrong layer). The
embeddings come with the stage that starts at layer 0, the final norm and LM head with
the stage that ends at the last layer. Weights are read by a plain name table, and only
the tensors of this range are read from disk.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarmd.errors import ModelLoadError
from swarmd.model.families import family_for
from swarmd.model.layers import LayerRange
from swarmd.model.rows import Row
from swarmd.model.tensorfile import tensor_files

if TYPE_CHECKING:
    from swarmd.model.quant import TensorSource


class StageModule(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: LayerRange) -> None:
        super().__init__()
        num_layers = int(config.num_hidden_layers)
        if layers.end > num_layers:
            raise ModelLoadError(f"Layers {layers} exceed the model's {num_layers} layers")
        family = family_for(config)
        self.layers_range = layers
        self.num_model_layers = num_layers
        self.stage_config = _stage_config(config, layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        with torch.device("meta"):
            self.embed = (
                nn.Embedding(self.vocab_size, self.hidden_size) if layers.is_first() else None
            )
            self.layers = nn.ModuleList(
                family.decoder_layer(self.stage_config, i) for i in range(layers.size)
            )
            last = layers.is_last(num_layers)
            eps = float(config.rms_norm_eps)
            self.norm = family.norm(self.hidden_size, eps=eps) if last else None
            self.lm_head = (
                nn.Linear(self.hidden_size, self.vocab_size, bias=False) if last else None
            )
        self.rotary = family.rotary(config=self.stage_config)
        self.mask_kinds = _mask_kinds(config, layers)

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    @property
    def weight_formats(self) -> set[str]:
        return {"fp32"}

    def new_cache(self, max_length: int = 0) -> DynamicCache:
        """A transformers cache; it grows as needed (`max_length` is the runtime's check)."""
        return DynamicCache(config=self.stage_config)

    def fork_cache(self, cache: DynamicCache, length: int, max_length: int) -> DynamicCache | None:
        """A copy of `cache` cut to its first `length` positions, or None where transformers
        cannot cut it (a sliding-window layer that has dropped positions)."""
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            return None
        copied = copy.deepcopy(cache)
        copied.crop(length - cache.get_seq_length())  # transformers 5: how many to drop, < 0
        return copied

    def view(self, layers: LayerRange) -> StageModule:
        """Layers [start, end) of this stage as a stage of their own, sharing the weights.

        A route may ask a node for part of what it holds. The view renumbers its layers
        from 0 (its cache indexes from 0), has the embeddings only when it starts at layer
        0 and the head only when it ends at the model's last layer.
        """
        held = self.layers_range
        if layers == held:
            return self
        lo, hi = layers.offsets_in(held)
        sub = StageModule.__new__(StageModule)
        nn.Module.__init__(sub)
        sub.layers_range = layers
        sub.num_model_layers = self.num_model_layers
        sub.stage_config = _stage_config(self.stage_config, LayerRange(lo, hi))
        sub.hidden_size = self.hidden_size
        sub.vocab_size = self.vocab_size
        sub.embed = self.embed if layers.is_first() else None
        sub.layers = nn.ModuleList(
            _renumbered(layer, i) for i, layer in enumerate(self.layers[lo:hi])
        )
        last = layers.is_last(self.num_model_layers)
        sub.norm = self.norm if last else None
        sub.lm_head = self.lm_head if last else None
        sub.rotary = self.rotary
        sub.mask_kinds = self.mask_kinds[lo:hi]
        return sub.eval()

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Run this stage's layers over one chunk of one sequence.

        Unlike the engine's, a position's bits here depend on how the sequence was cut
        into chunks: the float32 modules' chunked and stepwise results agree to about 1e-7.

        inputs: [1, T] token ids on the first stage, else [1, T, H] hidden states.
        Returns [1, T, H] hidden states, or on the last stage [1, V] float32 logits of the
        chunk's final position.
        """
        hidden = self.embed(inputs) if self.embed is not None else inputs  # [1, T, H]
        past = cache.get_seq_length()
        position_ids = torch.arange(past, past + hidden.shape[1]).unsqueeze(0)  # [1, T]
        masks = {
            kind: _MASK_BUILDERS[kind](
                config=self.stage_config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=cache,
                position_ids=position_ids,
            )
            for kind in set(self.mask_kinds)
        }
        position_embeddings = self.rotary(hidden, position_ids)
        for layer, kind in zip(self.layers, self.mask_kinds, strict=True):
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        if self.norm is None or self.lm_head is None:
            return hidden
        # [1, 1, H], not [1, H]: the 3-D matmul is the kernel `generate` uses, so the
        # logits are bit-identical to a plain transformers run.
        last = self.norm(hidden[:, -1:, :])
        return self.lm_head(last)[:, -1, :].float()  # [1, V]

    def forward_many(self, rows: list[Row]) -> list[torch.Tensor]:
        """One sequence at a time: this backend is the exact reference, and float32
        matmuls over several rows round differently from one row's (measured), so it
        does not batch."""
        return [self(row.inputs, row.cache) for row in rows]


_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


def _mask_kinds(config: PretrainedConfig, layers: LayerRange) -> list[str]:
    """The attention mask each layer of the range needs, as its full model builds it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = list(layer_types[layers.start : layers.end])
    elif config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        kinds = ["sliding_attention"] * layers.size  # Mistral slides on every layer
    else:
        kinds = ["full_attention"] * layers.size
    unknown = set(kinds) - set(_MASK_BUILDERS)
    if unknown:
        raise ModelLoadError(f"Unsupported attention layer types: {sorted(unknown)}")
    return kinds


def _renumbered(layer: nn.Module, index: int) -> nn.Module:
    """A shallow copy of a decoder layer whose attention uses cache slot `index`."""
    copy_ = copy.copy(layer)
    copy_._modules = dict(layer._modules)  # copy.copy would share the children's dict
    attn = copy.copy(layer.self_attn)
    attn.layer_idx = index
    copy_._modules["self_attn"] = attn
    if hasattr(copy_, "layer_idx"):
        copy_.layer_idx = index
    return copy_


def _stage_config(config: PretrainedConfig, layers: LayerRange) -> PretrainedConfig:
    stage_config = copy.deepcopy(config)
    stage_config.num_hidden_layers = layers.size
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        stage_config.layer_types = list(layer_types[layers.start : layers.end])
    # sdpa is what transformers picks on CPU for the full model; the same kernel keeps the
    # stage's numbers equal to a plain `generate`.
    stage_config._attn_implementation = "sdpa"
    return stage_config


def stage_weight_names(
    stage: StageModule, config: PretrainedConfig, has_head: bool = False
) -> dict[str, str]:
    """Map each parameter name of the stage to its name in a Hugging Face checkpoint.

    `has_head`: the checkpoint has its own `lm_head.weight`, as a last shard written by
    `swarmd shard` has even for a model that ties the head to the embeddings.
    """
    layers = stage.layers_range
    names: dict[str, str] = {}
    tied = bool(getattr(config, "tie_word_embeddings", False)) and not has_head
    for name, _ in stage.named_parameters():
        if name.startswith("embed."):
            names[name] = "model.embed_tokens." + name.removeprefix("embed.")
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            names[name] = f"model.layers.{int(index) + layers.start}.{rest}"
        elif name.startswith("norm."):
            names[name] = "model." + name
        elif name == "lm_head.weight":
            names[name] = "model.embed_tokens.weight" if tied else "lm_head.weight"
        else:
            raise ModelLoadError(f"No checkpoint name for stage parameter '{name}'")
    return names


def load_stage(
    model_dir: Path,
    config: PretrainedConfig,
    layers: LayerRange,
    dtype: torch.dtype,
    only: list[Path] | None = None,
    tensors: TensorSource | None = None,
) -> StageModule:
    """Build the stage for `layers` and read only its tensors from `model_dir`.

    `only`: the files to read (a sharded model's shards for this range); `tensors`: read
    from these instead (a GGUF file in place, planned as float32).
    """
    stage = StageModule(config, layers)
    if tensors is not None:
        return _load_from(stage, config, layers, dtype, tensors)
    files = tensor_files(model_dir, only)
    names = stage_weight_names(stage, config, has_head="lm_head.weight" in files)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for stage_name, ckpt_name in names.items():
        if ckpt_name not in files:
            raise ModelLoadError(f"Tensor '{ckpt_name}' is missing from {model_dir}")
        by_file.setdefault(files[ckpt_name], []).append((stage_name, ckpt_name))
    state: dict[str, torch.Tensor] = {}
    for file, pairs in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for stage_name, ckpt_name in pairs:
                state[stage_name] = handle.get_tensor(ckpt_name).to(dtype)
    return _assign(stage, layers, state)


def _load_from(
    stage: StageModule,
    config: PretrainedConfig,
    layers: LayerRange,
    dtype: torch.dtype,
    tensors: TensorSource,
) -> StageModule:
    names = stage_weight_names(stage, config, has_head="lm_head.weight" in tensors)
    state: dict[str, torch.Tensor] = {}
    for stage_name, ckpt_name in names.items():
        if ckpt_name not in tensors:
            raise ModelLoadError(f"Tensor '{ckpt_name}' is missing from the model's file")
        state[stage_name] = tensors.get(ckpt_name).to(dtype)
    return _assign(stage, layers, state)


def _assign(stage: StageModule, layers: LayerRange, state: dict[str, torch.Tensor]) -> StageModule:
    stage.load_state_dict(state, strict=False, assign=True)
    meta = [n for n, p in stage.named_parameters() if p.is_meta]
    if meta:
        raise ModelLoadError(f"Stage {layers} has parameters with no weights: {meta[:5]}")
    # Tensors are cast one by one above, never the module: casting the module would also
    # cast the rotary inv_freq buffer and shift positions in half precision.
    return stage.eval()
