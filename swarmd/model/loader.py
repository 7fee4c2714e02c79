"""`LoadedModel`: what a node holds of one model (its stage, tokenizer and facts)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from swarmd.errors import ConfigError, ModelLoadError
from swarmd.model.layers import LayerRange
from swarmd.model.shards import verify_files
from swarmd.model.source import ModelSource
from swarmd.model.stage import StageModule, load_stage
from swarmd.model.text import TextCodec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model_id: str
    source: ModelSource
    config: PretrainedConfig
    layers: LayerRange
    dtype_name: str
    stage: StageModule
    codec: TextCodec

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def context_length(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def is_whole(self) -> bool:
        return self.layers == LayerRange(0, self.num_layers)


def load_model(source: ModelSource, layers: str | None, dtype_name: str) -> LoadedModel:
    """Load the layer range `layers` ('START:END'; None = all) of a resolved model."""
    if dtype_name not in DTYPES:
        raise ConfigError(f"dtype '{dtype_name}' is not one of {', '.join(DTYPES)}")
    config = _config(source)
    num_layers = int(config.num_hidden_layers)
    layer_range = LayerRange.parse(layers, num_layers) if layers else LayerRange(0, num_layers)
    only: list[Path] | None = None
    if source.manifest is not None:
        # Every file this range needs is hashed before any of it is loaded or announced.
        verify_files(source.model_dir, source.manifest.files_for(layer_range))
        only = [source.model_dir / s.file for s in source.manifest.shards_for(layer_range)]
    started = time.monotonic()
    stage = load_stage(source.model_dir, config, layer_range, DTYPES[dtype_name], only)
    codec = TextCodec.load(source.model_dir)
    log.info(
        "loaded %s layers %s of %d (%s) in %.2f s",
        source.model_id,
        layer_range,
        num_layers,
        dtype_name,
        time.monotonic() - started,
    )
    return LoadedModel(source.model_id, source, config, layer_range, dtype_name, stage, codec)


def _config(source: ModelSource) -> PretrainedConfig:
    try:
        if source.manifest is not None:
            return AutoConfig.for_model(**source.manifest.config)
        return AutoConfig.from_pretrained(str(source.model_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the config of {source.model_dir}: {exc}") from exc
