"""A stage equals the full transformers model: whole, split, chunked and step by step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

from swarmd.errors import ModelLoadError
from swarmd.model.layers import LayerRange
from swarmd.model.stage import StageModule, load_stage
from tests.conftest import TINY

FAMILIES = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
}


def make_tiny(family: str, out: Path) -> tuple[Path, PretrainedConfig, torch.nn.Module]:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(out))
    return out, model.config, model


def prompt(length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=generator)  # [1, T]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_stage_is_bit_equal_to_transformers(family: str, tmp_path: Path) -> None:
    path, config, model = make_tiny(family, tmp_path)
    stage = load_stage(path, config, LayerRange(0, 4), torch.float32)
    ids = prompt(12)
    with torch.inference_mode():
        expected = model(ids, logits_to_keep=1).logits[:, -1, :]
    got = stage(ids, stage.new_cache())
    if config.tie_word_embeddings:
        assert torch.equal(got, expected)  # the embedded model's case: bit for bit
    else:
        # An untied LM head read from safetensors may take another matmul kernel path:
        # one float32 ulp, never a different token.
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_stages_chain_to_the_same_logits(family: str, split: int, tmp_path: Path) -> None:
    path, config, model = make_tiny(family, tmp_path)
    first = load_stage(path, config, LayerRange(0, split), torch.float32)
    last = load_stage(path, config, LayerRange(split, 4), torch.float32)
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    ids = prompt(10)
    with torch.inference_mode():
        out = model(ids, logits_to_keep=1, output_hidden_states=True)
    hidden = first(ids, first.new_cache())  # [1, T, H]
    assert torch.equal(hidden, out.hidden_states[split])  # bit for bit at the boundary
    logits = last(hidden, last.new_cache())
    torch.testing.assert_close(logits, out.logits[:, -1, :], rtol=0, atol=1e-6)


def test_chunked_prefill_gives_the_logits_of_one_piece(tmp_path: Path) -> None:
    path, config, _ = make_tiny("llama", tmp_path)
    stage = load_stage(path, config, LayerRange(0, 4), torch.float32)
    ids = prompt(50)
    one_piece = stage(ids, stage.new_cache())
    cache = stage.new_cache()
    for start in range(0, 50, 16):
        chunked = stage(ids[:, start : start + 16], cache)
    assert cache.get_seq_length() == 50
    torch.testing.assert_close(chunked, one_piece, rtol=0, atol=1e-5)
    assert torch.argmax(chunked) == torch.argmax(one_piece)


def test_step_by_step_greedy_equals_generate(tmp_path: Path) -> None:
    path, config, model = make_tiny("llama", tmp_path)
    first = load_stage(path, config, LayerRange(0, 2), torch.float32)
    last = load_stage(path, config, LayerRange(2, 4), torch.float32)
    ids = prompt(8)
    with torch.inference_mode():
        expected = model.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    cache_a, cache_b = first.new_cache(), last.new_cache()
    logits = last(first(ids, cache_a), cache_b)
    tokens: list[int] = []
    for _ in range(20):
        token = int(torch.argmax(logits[0]))
        tokens.append(token)
        step = torch.tensor([[token]])  # [1, 1]
        logits = last(first(step, cache_a), cache_b)
    assert tokens == expected[0, 8:].tolist()


def test_stage_reads_only_its_own_tensors(tmp_path: Path) -> None:
    path, config, _ = make_tiny("mistral", tmp_path)
    middle = load_stage(path, config, LayerRange(1, 3), torch.float32)
    assert middle.embed is None and middle.norm is None and middle.lm_head is None
    assert len(middle.layers) == 2
    names = {n for n, _ in middle.named_parameters()}
    assert all(n.startswith("layers.") for n in names)


def test_half_precision_keeps_rotary_in_float32(tmp_path: Path) -> None:
    path, config, _ = make_tiny("llama", tmp_path)
    stage = load_stage(path, config, LayerRange(0, 4), torch.bfloat16)
    assert stage.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert stage.rotary.inv_freq.dtype == torch.float32
    out = stage(prompt(6), stage.new_cache())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path, config, model = make_tiny("qwen2", tmp_path)
    state = {k: v for k, v in model.state_dict().items() if "layers.2." not in k}
    (path / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\."):
        load_stage(path, config, LayerRange(0, 4), torch.float32)


def test_unknown_architecture_is_refused() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    config.num_hidden_layers = 2
    with pytest.raises(ModelLoadError, match="gpt2"):
        StageModule(config, LayerRange(0, 2))


def test_range_past_the_model_is_refused(tmp_path: Path) -> None:
    _, config, _ = make_tiny("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="exceed"):
        StageModule(config, LayerRange(2, 5))
