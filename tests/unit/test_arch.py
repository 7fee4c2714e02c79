"""ArchSpec reads a config dict with the defaults transformers' config classes have."""

from __future__ import annotations

import math
from typing import Any

import pytest
from transformers import AutoConfig

from swarmd.engine.arch import FULL, SLIDING, arch_spec

CASES: list[dict[str, Any]] = [
    {"model_type": "llama"},
    {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3},
    {
        "model_type": "llama",
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    {
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    {"model_type": "mistral"},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "qwen2"},
    {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 2,
    },
    {"model_type": "qwen3", "head_dim": 64},
    {"model_type": "qwen3", "attention_bias": True},
    {"model_type": "gemma3_text"},
    {"model_type": "gemma3_text", "rope_theta": 5000.0, "sliding_window": 128},
    {"model_type": "gemma3_text", "query_pre_attn_scalar": 144, "head_dim": 128},
]


def _rope_theta(params: dict[str, Any], kind: str) -> float:
    if kind in params:
        params = params[kind]
    return float(params["rope_theta"])


@pytest.mark.parametrize(
    "given", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60]
)
def test_arch_spec_agrees_with_transformers(given: dict[str, Any]) -> None:
    config = {"num_hidden_layers": 6, **given}
    spec = arch_spec(config)
    hf = AutoConfig.for_model(**config)
    assert spec.hidden == hf.hidden_size
    assert spec.heads == hf.num_attention_heads
    assert spec.kv_heads == hf.num_key_value_heads
    assert spec.head_dim == (
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    )
    assert spec.intermediate == hf.intermediate_size
    assert spec.vocab == hf.vocab_size
    assert spec.eps == hf.rms_norm_eps
    assert spec.max_positions == hf.max_position_embeddings
    assert spec.tie_embeddings == hf.tie_word_embeddings
    hf_window = getattr(hf, "sliding_window", None)
    if spec.model_type in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        hf_window = None
    assert spec.sliding_window == hf_window
    hf_types = getattr(hf, "layer_types", None)
    if hf_types is None:
        hf_types = [SLIDING if hf_window is not None else FULL] * hf.num_hidden_layers
    assert list(spec.layer_types) == list(hf_types)
    for kind in set(spec.layer_types):
        assert spec.rope[kind].theta == _rope_theta(hf.rope_parameters, kind)
        hf_kind = hf.rope_parameters.get(kind, hf.rope_parameters).get("rope_type", "default")
        assert spec.rope[kind].kind == hf_kind
    if spec.is_gemma:
        assert math.isclose(spec.attn_scale, hf.query_pre_attn_scalar**-0.5)
        assert spec.activation == "gelu_tanh" and spec.qk_norm
    else:
        assert math.isclose(spec.attn_scale, spec.head_dim**-0.5)
        assert spec.activation == "silu"
    assert spec.qkv_bias == (
        spec.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
    )


@pytest.mark.parametrize("given", [c for c in CASES if c["model_type"] == "llama"])
def test_rotary_frequencies_equal_transformers(given: dict[str, Any]) -> None:
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from swarmd.engine.rope import inverse_frequencies

    config = {"num_hidden_layers": 2, **given}
    spec = arch_spec(config)
    hf = AutoConfig.for_model(**config)
    kind = hf.rope_parameters.get("rope_type", "default")
    if kind == "default":
        expected = LlamaRotaryEmbedding(hf).inv_freq
    else:
        expected = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))[0]
    assert torch.equal(inverse_frequencies(spec.rope[FULL], spec.head_dim), expected)
