"""`LoadedModel`: what a node holds of one model (its stage, tokenizer and facts), and
`load_model`, which picks how the stage runs.

Two backends run a stage:
- **engine** (`swarmd.engine`): our own forward for the Llama family and Gemma 3, with
  weights held int4 / int8 / bf16 / fp16 / fp32 and matrix kernels fed in `dtype`.
- **transformers**: the architecture's own transformers modules in float32, bit-equal to
  a plain transformers run. It runs `--weights fp32 --dtype float32` (the exact path) and
  any family the engine does not cover.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmd.dtypes import (
    AUTO,
    COMPUTE_DTYPES,
    WEIGHT_FORMATS,
    default_compute_dtype,
    held_format,
    label_formats,
    weights_label,
)
from swarmd.errors import ConfigError, ModelLoadError
from swarmd.model.common import Variant, config_context_length, config_num_layers
from swarmd.model.gguf_manifest import verify_gguf
from swarmd.model.gguf_tensors import GgufTensors
from swarmd.model.grammar import Constraint, GrammarSpec, Vocabulary, compile_grammar
from swarmd.model.hashing import verify_files
from swarmd.model.layers import LayerRange
from swarmd.model.quant import StoredTensors, TensorSource
from swarmd.model.runtime import TRIAL_PROMPT, Stage, trial_forward
from swarmd.model.source import ModelSource
from swarmd.model.text import TextCodec

log = logging.getLogger(__name__)

ENGINE = "engine"
TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    source: ModelSource
    config: dict[str, Any]  # the Hugging Face config, as a dict
    layers: LayerRange
    weights: str  # how the model's layer matrices are held: int4, ..., or e.g. int4+int8
    dtype_name: str  # what the matrix kernels read ("bfloat16", ...)
    hidden_dtype: torch.dtype  # the hidden states this stage takes and gives
    backend: str  # ENGINE or TRANSFORMERS
    stage: Stage
    codec: TextCodec
    # What a prompt token costs the whole model at this stage's speed (its trial prefill,
    # scaled to every layer): bounds the prefill chunks that must fit in a step timeout.
    prompt_token_s: float = 0.0

    @property
    def num_layers(self) -> int:
        return config_num_layers(self.config)

    @property
    def kernels(self) -> str:
        """Whose kernels its quantized matrices run: "swarmd", "torch", "swarmd+torch" or
        "none" (README "Weights, compute dtype and the engine")."""
        kinds = getattr(self.stage, "quantized_kernels", None)
        return kinds if isinstance(kinds, str) else "none"

    @property
    def attention(self) -> str:
        """Whose attention its layers run: "swarmd" (attend.cpp) or "torch"."""
        return "swarmd" if getattr(self.stage, "native_attention", False) is True else "torch"

    @property
    def variant(self) -> Variant:
        return Variant(self.source.content_id, self.weights, self.dtype_name)

    @property
    def context_length(self) -> int:
        return config_context_length(self.config)

    @property
    def vocab_size(self) -> int:
        return self.stage.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.stage.hidden_size

    @property
    def is_whole(self) -> bool:
        return self.layers == LayerRange(0, self.num_layers)

    @functools.cached_property
    def grammar_vocabulary(self) -> Vocabulary:
        """The tokenizer as the grammar library sees it; built on first use (about 1 s),
        by the first request with a grammar."""
        return Vocabulary(self.codec.tokenizer, self.vocab_size, self.codec.eos_ids)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` (cached): a 400 naming its parameter if it does not."""
        compile_grammar(spec, self.grammar_vocabulary)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh state of `spec` for one reply (compiled once, then cached)."""
        return Constraint(compile_grammar(spec, self.grammar_vocabulary))


def cpu_capability() -> str:
    return str(torch.backends.cpu.get_cpu_capability())


def load_model(
    source: ModelSource, layers: str | None, weights: str = AUTO, dtype: str = AUTO
) -> LoadedModel:
    """Load the layer range `layers` ('START:END'; None = all) of a resolved model."""
    if weights != AUTO and weights not in WEIGHT_FORMATS:
        raise ConfigError(f"weights '{weights}' is not auto or one of {', '.join(WEIGHT_FORMATS)}")
    if dtype != AUTO and dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not auto or one of {', '.join(COMPUTE_DTYPES)}")
    config = read_config(source)
    num_layers = int(config["num_hidden_layers"])
    layer_range = LayerRange.parse(layers, num_layers) if layers else LayerRange(0, num_layers)
    tensors = open_tensors(source, layer_range, weights)  # a sharded model's: verified first
    # The tokenizer before the weights: its parse peaks above what it keeps.
    codec = TextCodec.load(source.model_dir)
    stored = _range_formats(tensors, layer_range)  # this range's
    # The whole model's formats decide the dtype and the label every holder announces, so
    # nodes holding different ranges of one model agree on both (routes compare them).
    if source.manifest is not None:
        model_stored = label_formats(source.manifest.weights)
    elif isinstance(tensors, GgufTensors):
        model_stored = tensors.formats_of_layers(0, num_layers)
    else:
        model_stored = stored
    if dtype == AUTO:
        wanted = model_stored if weights == AUTO else {weights}
        dtype = default_compute_dtype(frozenset(wanted), cpu_capability())
    if isinstance(tensors, GgufTensors) and dtype == "bfloat16":
        tensors.keep_blocks = blocks_kernel()
    held = {held_format(fmt, weights, dtype) for fmt in stored or {"fp32"}}
    label = weights_label({held_format(fmt, weights, dtype) for fmt in model_stored or {"fp32"}})
    started = time.monotonic()
    try:
        backend, stage, hidden = _load_stage(
            source, config, tensors, layer_range, weights, held, stored, dtype
        )
    finally:
        tensors.close()
    try:
        # A stage that cannot run refuses to start here, not on every request once announced.
        trial_s = trial_forward(stage)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise ModelLoadError(
            f"Layers {layer_range} of {source.model_id} do not run: {exc}"
        ) from exc
    token_s = trial_s / TRIAL_PROMPT * num_layers / max(1, layer_range.size)
    model = LoadedModel(
        source.model_id,
        source,
        config,
        layer_range,
        label,
        dtype,
        hidden,
        backend,
        stage,
        codec,
        token_s,
    )
    log.info(
        "loaded %s layers %s of %d (%s weights; this range holds %s; %s kernels; %s; "
        "int4/int8 kernels: %s; attention: %s) in %.2f s",
        source.model_id,
        layer_range,
        num_layers,
        label,
        weights_label(stage.weight_formats),
        dtype,
        "swarmd engine" if backend == ENGINE else "transformers modules",
        model.kernels,
        model.attention,
        time.monotonic() - started,
    )
    return model


def open_tensors(source: ModelSource, layers: LayerRange, weights: str) -> TensorSource:
    """The tensors of `layers`, each read when asked for: a GGUF file's in place, or the
    safetensors files of a folder (a sharded model's verified first)."""
    if source.gguf is not None:
        if source.manifest is not None:  # memo: the cache's models/ (or shards/, fetched)
            verify_gguf(source.gguf, source.manifest, source.model_dir.parent)
        return GgufTensors(source.gguf, source.model_dir, weights)
    return StoredTensors(_files(source, layers))


def blocks_kernel() -> bool:
    """Whether Q4_0 / Q8_0 matrices run on swarmd's block kernel here (held as the file's
    blocks), rather than as torch's int4 / int8 forms."""
    from swarmd.engine import native

    return native.blocks_op() is not None


def model_formats(source: ModelSource) -> set[str]:
    """The formats a model's layer matrices are stored in (read from headers only)."""
    if source.manifest is not None:
        return label_formats(source.manifest.weights)
    if source.gguf is not None:
        with GgufTensors(source.gguf, source.model_dir, AUTO) as tensors:
            return tensors.formats_of_layers(0, config_num_layers(read_config(source)))
    from swarmd.engine.load import stored_formats

    return stored_formats(sorted(source.model_dir.glob("*.safetensors")))


def _range_formats(tensors: TensorSource, layers: LayerRange) -> set[str]:
    if isinstance(tensors, GgufTensors):
        return tensors.formats_of_layers(layers.start, layers.end)
    from swarmd.engine.load import stored_formats

    return stored_formats(tensors.files)


def _files(source: ModelSource, layers: LayerRange) -> list[Path]:
    """The weight files of `layers` (a sharded model's are verified first)."""
    if source.manifest is not None:
        # Every file this range needs is hashed before any of it is loaded or announced.
        verify_files(source.model_dir, source.manifest.files_for(layers))
        return [source.model_dir / s.file for s in source.manifest.shards_for(layers)]
    index = source.model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({source.model_dir / f for f in weight_map.values()})
    files = sorted(source.model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No .safetensors files in {source.model_dir}")
    return files


def _load_stage(
    source: ModelSource,
    config: dict[str, Any],
    tensors: TensorSource,
    layers: LayerRange,
    weights: str,
    held: set[str],
    stored: set[str],
    dtype: str,
) -> tuple[str, Stage, torch.dtype]:
    from swarmd.engine.arch import arch_spec, engine_covers

    dense_files = stored <= {"fp32", "bf16", "fp16"}
    exact = held == {"fp32"} and dtype == "float32" and dense_files
    exact = exact and not config.get("rope_freq_factors")
    if exact or not engine_covers(config):
        from swarmd.model.families import has_transformers_stage

        if has_transformers_stage(config):
            if not exact:
                raise ModelLoadError(
                    f"{config.get('model_type')} runs through transformers modules, with float32 "
                    "weights only: use --weights fp32 --dtype float32"
                )
            if not engine_covers(config):
                log.info("the engine does not cover %s: transformers modules run it", config)
            from swarmd.model.stage import load_stage

            stage = load_stage(
                source.model_dir, _hf_config(config), layers, torch.float32, tensors=tensors
            )
            return TRANSFORMERS, stage, torch.float32
    from swarmd.engine.load import load_lean_stage
    from swarmd.engine.stage import ACT

    spec = arch_spec(config)
    stage = load_lean_stage(tensors, spec, layers, weights, getattr(torch, dtype))
    return ENGINE, stage, ACT


def read_config(source: ModelSource) -> dict[str, Any]:
    if source.manifest is not None:
        return dict(source.manifest.config)
    path = source.model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("num_hidden_layers"), int):
        raise ModelLoadError(f"{path} has no num_hidden_layers")
    return config


def _hf_config(config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the config: {exc}") from exc
