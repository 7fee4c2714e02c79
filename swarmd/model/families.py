"""Which transformers classes build one stage of each architecture of the exact path.

A stage is built from the architecture's own decoder layer, norm and rotary classes, so
its numbers match the full transformers model exactly (`--weights fp32 --dtype float32`).
Only architectures whose decoder layers share Llama's call signature are listed; each has
an exact-match test. The engine (`swarmd.engine`) runs these and Gemma 3 in every format.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    decoder_layer: type[nn.Module]
    norm: type[nn.Module]
    rotary: type[nn.Module]


# model_type -> class-name prefix inside transformers.models.<type>.modeling_<type>
_PREFIXES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}


def supported_model_types() -> list[str]:
    """Every architecture swarmd runs (by the engine or by transformers modules)."""
    from swarmd.engine.arch import MODEL_TYPES

    return sorted({*_PREFIXES, *MODEL_TYPES})


def has_transformers_stage(config: dict[str, object]) -> bool:
    return str(config.get("model_type")) in _PREFIXES


def family_for(config: PretrainedConfig) -> Family:
    model_type = getattr(config, "model_type", None)
    prefix = _PREFIXES.get(str(model_type))
    if prefix is None:
        raise ModelLoadError(
            f"Architecture '{model_type}' has no transformers stage; those are "
            f"{', '.join(sorted(_PREFIXES))}"
        )
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return Family(
        model_type=str(model_type),
        decoder_layer=getattr(module, f"{prefix}DecoderLayer"),
        norm=getattr(module, f"{prefix}RMSNorm"),
        rotary=getattr(module, f"{prefix}RotaryEmbedding"),
    )
