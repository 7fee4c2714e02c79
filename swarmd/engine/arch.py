"""`ArchSpec`: the facts of a model's config that the engine's forward needs, per family.

Read from the Hugging Face config as a plain dict (config.json, or a manifest's config),
with each family's defaults as transformers' config classes have them (a unit test holds
the two side by side), so the engine never imports transformers: its modelling code alone
costs a node about 100 MB of memory.

Families: the Llama family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norms)
and Gemma 3 (scaled embeddings, (1 + w) RMSNorm, GeGLU, q/k norms, four norms a layer,
interleaved sliding-window and global layers, a rotary base per layer type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarmd.errors import ModelLoadError

FULL = "full_attention"
SLIDING = "sliding_attention"
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
GEMMA3 = "gemma3_text"
MODEL_TYPES = frozenset({*LLAMA_FAMILY, GEMMA3})
ROPE_KINDS = frozenset({"default", "linear", "llama3"})


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    freq_factors: tuple[float, ...] = ()  # llama.cpp's rope_freqs (Llama 3 GGUFs)


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    activation: str  # silu | gelu_tanh
    attn_scale: float  # the softmax scale
    layer_types: tuple[str, ...]  # FULL or SLIDING, one per layer
    sliding_window: int | None
    rope: dict[str, RopeSpec]  # per layer type
    final_softcap: float | None = None
    attn_softcap: float | None = None

    @property
    def is_gemma(self) -> bool:
        return self.model_type == GEMMA3

    @property
    def embed_scale(self) -> float:
        """Gemma multiplies embeddings by sqrt(hidden) (in the activation dtype)."""
        return math.sqrt(self.hidden) if self.is_gemma else 1.0

    @property
    def norm_offset(self) -> float:
        """Gemma's RMSNorm multiplies by (1 + w)."""
        return 1.0 if self.is_gemma else 0.0


def engine_covers(config: dict[str, Any]) -> bool:
    return str(config.get("model_type")) in MODEL_TYPES


def arch_spec(config: dict[str, Any]) -> ArchSpec:
    """The ArchSpec of a config dict; ModelLoadError naming what is not supported."""
    model_type = str(config.get("model_type"))
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(
            f"Architecture '{model_type}' is not supported by the engine; it runs "
            f"{', '.join(sorted(MODEL_TYPES))}"
        )
    gemma = model_type == GEMMA3
    try:
        heads = int(config.get("num_attention_heads", 8 if gemma else 32))
        hidden = int(config.get("hidden_size", 2304 if gemma else 4096))
        num_layers = int(config.get("num_hidden_layers", 26 if gemma else 32))
        default_kv = {"mistral": 8, GEMMA3: 4}.get(model_type, heads)
        kv_heads = int(config.get("num_key_value_heads") or default_kv)
        head_dim = int(config.get("head_dim") or (256 if gemma else hidden // heads))
        spec = ArchSpec(
            model_type=model_type,
            hidden=hidden,
            num_layers=num_layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=int(config.get("intermediate_size", _INTERMEDIATE[model_type])),
            vocab=int(config.get("vocab_size", _VOCAB[model_type])),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=int(config.get("max_position_embeddings", _MAX_POS[model_type])),
            tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=_qkv_bias(config, model_type),
            o_bias=model_type in ("llama", "qwen3", GEMMA3) and _flag(config, "attention_bias"),
            mlp_bias=model_type == "llama" and _flag(config, "mlp_bias"),
            qk_norm=model_type in ("qwen3", GEMMA3),
            activation=_activation(config, model_type),
            attn_scale=_attn_scale(config, gemma, head_dim),
            layer_types=_layer_types(config, model_type, num_layers),
            sliding_window=_sliding_window(config, model_type),
            rope=_rope(config, gemma),
            final_softcap=_optional_float(config, "final_logit_softcapping"),
            attn_softcap=_optional_float(config, "attn_logit_softcapping"),
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"The {model_type} config cannot be read: {exc}") from exc
    _check(spec, config)
    return spec


_INTERMEDIATE = {"llama": 11008, "mistral": 14336, "qwen2": 22016, "qwen3": 22016, GEMMA3: 9216}
_VOCAB = {"llama": 32000, "mistral": 32000, "qwen2": 151936, "qwen3": 151936, GEMMA3: 262208}
_MAX_POS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, GEMMA3: 131072}


def _flag(config: dict[str, Any], key: str) -> bool:
    return bool(config.get(key) or False)


def _optional_float(config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    return None if value is None else float(value)


def _qkv_bias(config: dict[str, Any], model_type: str) -> bool:
    if model_type == "qwen2":
        return True  # Qwen2's q/k/v always carry a bias, o never
    if model_type == "mistral":
        return False
    return _flag(config, "attention_bias")


def _activation(config: dict[str, Any], model_type: str) -> str:
    key = "hidden_activation" if model_type == GEMMA3 else "hidden_act"
    default = "gelu_pytorch_tanh" if model_type == GEMMA3 else "silu"
    name = str(config.get(key) or default)
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ModelLoadError(f"Activation '{name}' is not supported by the engine")


def _attn_scale(config: dict[str, Any], gemma: bool, head_dim: int) -> float:
    if gemma:
        return float(config.get("query_pre_attn_scalar") or 256) ** -0.5
    return float(head_dim) ** -0.5


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        return None
    default = 4096 if model_type in ("mistral", "qwen2", "qwen3", GEMMA3) else None
    value = config.get("sliding_window", default)
    return None if value is None else int(value)


def _layer_types(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    given = config.get("layer_types")
    if given:
        types = tuple(str(t) for t in given)
    elif model_type == GEMMA3:
        pattern = int(
            config.get("_sliding_window_pattern") or config.get("sliding_window_pattern") or 6
        )
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    elif model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        start = int(config.get("max_window_layers", 28))
        types = tuple(SLIDING if i >= start else FULL for i in range(num_layers))
    else:
        types = (FULL,) * num_layers
    if model_type == "mistral" and _sliding_window(config, model_type) is not None:
        types = (SLIDING,) * num_layers  # Mistral slides on every layer
    if len(types) != num_layers or set(types) - {FULL, SLIDING}:
        raise ModelLoadError(f"layer_types {list(types)[:8]}... do not fit {num_layers} layers")
    return types


def _rope(config: dict[str, Any], gemma: bool) -> dict[str, RopeSpec]:
    params = config.get("rope_parameters")
    factors = tuple(float(f) for f in config.get("rope_freq_factors") or ())
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return {kind: _rope_spec(p, factors) for kind, p in params.items()}
    if gemma:
        scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else {}
        full = {"rope_theta": config.get("rope_theta", 1_000_000.0), **(scaling or {})}
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
        return {FULL: _rope_spec(full, factors), SLIDING: _rope_spec(local, ())}
    if not isinstance(params, dict):
        scaling = config.get("rope_scaling")
        params = {"rope_theta": config.get("rope_theta", 10_000.0), **(scaling or {})}
    spec = _rope_spec(params, factors)
    return {FULL: spec, SLIDING: spec}


def _rope_spec(params: dict[str, Any], factors: tuple[float, ...]) -> RopeSpec:
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind not in ROPE_KINDS:
        raise ModelLoadError(
            f"Rotary scaling '{kind}' is not supported by the engine "
            f"({', '.join(sorted(ROPE_KINDS))})"
        )
    return RopeSpec(
        theta=float(params.get("rope_theta", 10_000.0)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_positions=int(params.get("original_max_position_embeddings", 8192)),
        freq_factors=factors if kind == "default" else (),
    )


def _check(spec: ArchSpec, config: dict[str, Any]) -> None:
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError("A partial rotary factor is not supported by the engine")
    if spec.attn_softcap is not None:
        raise ModelLoadError("Attention logit soft-capping is not supported by the engine")
    if spec.heads % spec.kv_heads:
        raise ModelLoadError(f"{spec.heads} heads do not share {spec.kv_heads} KV heads evenly")
    if spec.head_dim % 2:
        raise ModelLoadError(f"head_dim {spec.head_dim} is odd")
    for kind in set(spec.layer_types):
        if kind not in spec.rope:
            raise ModelLoadError(f"No rotary parameters for {kind} layers")
