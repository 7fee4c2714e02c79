"""`StageModule.view`: part of a held stage, run on its own, equals the whole bit for bit.

A route may ask a node for part of the layers it holds; the view shares the weights,
renumbers its layers from 0 for its own cache, and must leave the stage it came from as it
was. `StageRuntime.open(..., layers=...)` runs a session over such a view.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, DynamicCache, PretrainedConfig

from swarmd.errors import ModelLoadError
from swarmd.model.layers import LayerRange
from swarmd.model.runtime import StageRuntime
from swarmd.model.sampling import SamplingParams
from swarmd.model.stage import StageModule, load_stage

NUM_LAYERS = 4
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def config(tiny_chat_dir: Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(tiny_chat_dir))


def load(model_dir: Path, config: PretrainedConfig, start: int, end: int) -> StageModule:
    return load_stage(model_dir, config, LayerRange(start, end), torch.float32)


def prompt(length: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab_size, (1, length), generator=generator)  # [1, T]


def run_chain(
    stages: list[StageModule], caches: list[DynamicCache], inputs: torch.Tensor
) -> torch.Tensor:
    out = inputs
    for stage, cache in zip(stages, caches, strict=True):
        out = stage(out, cache)
    return out


def greedy_logits(
    stages: list[StageModule], ids: torch.Tensor, steps: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `ids`, then `steps` greedy single-token decodes: each step's logits, tokens."""
    caches = [stage.new_cache() for stage in stages]
    logits = run_chain(stages, caches, ids)
    all_logits, tokens = [logits], []
    for _ in range(steps):
        token = int(torch.argmax(logits[0]))
        tokens.append(token)
        logits = run_chain(stages, caches, torch.tensor([[token]]))  # [1, 1]
        all_logits.append(logits)
    lengths = {cache.get_seq_length() for cache in caches}
    assert lengths == {ids.shape[1] + steps}
    return all_logits, tokens


def assert_all_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {i} differs"


def test_chained_views_equal_the_whole_stage(tiny_chat_dir: Path, config: PretrainedConfig) -> None:
    whole = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    held = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    views = [held.view(LayerRange(0, 1)), held.view(LayerRange(1, 3)), held.view(LayerRange(3, 4))]
    assert views[0].is_first and not views[0].is_last
    assert not views[1].is_first and not views[1].is_last
    assert views[2].is_last and not views[2].is_first
    assert [len(v.layers) for v in views] == [1, 2, 1]
    ids = prompt(11, config.vocab_size)
    expected, expected_tokens = greedy_logits([whole], ids, DECODE_STEPS)
    got, tokens = greedy_logits(views, ids, DECODE_STEPS)
    assert tokens == expected_tokens
    assert_all_equal(got, expected)


def test_view_hidden_states_equal_a_stage_loaded_for_that_range(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    held = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    loaded = load(tiny_chat_dir, config, 0, 2)
    view = held.view(LayerRange(0, 2))
    ids = prompt(9, config.vocab_size)
    hidden = view(ids, view.new_cache())  # [1, T, H]
    assert hidden.shape == (1, 9, config.hidden_size)
    assert torch.equal(hidden, loaded(ids, loaded.new_cache()))


def test_view_of_a_stage_without_embeddings(tiny_chat_dir: Path, config: PretrainedConfig) -> None:
    whole = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    front = load(tiny_chat_dir, config, 0, 2)
    held = load(tiny_chat_dir, config, 1, NUM_LAYERS)  # no embeddings
    tail = load(tiny_chat_dir, config, 2, NUM_LAYERS)
    view = held.view(LayerRange(2, NUM_LAYERS))
    assert not view.is_first and view.is_last and len(view.layers) == 2
    ids = prompt(7, config.vocab_size)
    expected, expected_tokens = greedy_logits([whole], ids, DECODE_STEPS)
    got, tokens = greedy_logits([front, view], ids, DECODE_STEPS)
    assert tokens == expected_tokens
    assert_all_equal(got, expected)
    loaded, _ = greedy_logits([front, tail], ids, DECODE_STEPS)
    assert_all_equal(got, loaded)


def test_view_of_the_held_range_is_the_stage_itself(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    held = load(tiny_chat_dir, config, 1, 3)
    assert held.view(LayerRange(1, 3)) is held


@pytest.mark.parametrize(("start", "end"), [(0, 2), (0, 3), (2, 4), (3, 4), (0, 4), (2, 5)])
def test_view_outside_the_held_range_is_refused(
    tiny_chat_dir: Path, config: PretrainedConfig, start: int, end: int
) -> None:
    held = load(tiny_chat_dir, config, 1, 3)
    with pytest.raises(ModelLoadError, match="not inside"):
        held.view(LayerRange(start, end))


def test_views_share_the_weights(tiny_chat_dir: Path, config: PretrainedConfig) -> None:
    held = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    head = held.view(LayerRange(0, 2))
    tail = held.view(LayerRange(2, NUM_LAYERS))
    assert head.embed is held.embed and head.norm is None and head.lm_head is None
    assert tail.embed is None and tail.norm is held.norm and tail.lm_head is held.lm_head
    for view, offset in ((head, 0), (tail, 2)):
        for i, layer in enumerate(view.layers):
            original = held.layers[offset + i]
            for (name, param), (original_name, original_param) in zip(
                layer.named_parameters(), original.named_parameters(), strict=True
            ):
                assert name == original_name
                assert param.data_ptr() == original_param.data_ptr(), name
    view_params = {p.data_ptr() for v in (head, tail) for p in v.parameters()}
    assert view_params == {p.data_ptr() for p in held.parameters()}
    # A change to the held weights shows in the view: one copy in memory.
    with torch.no_grad():
        held.layers[3].mlp.down_proj.weight.mul_(2)
    assert torch.equal(tail.layers[1].mlp.down_proj.weight, held.layers[3].mlp.down_proj.weight)


def test_views_renumber_their_layers_from_zero(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    held = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    view = held.view(LayerRange(1, 3))
    assert [layer.self_attn.layer_idx for layer in view.layers] == [0, 1]
    assert [layer.self_attn.layer_idx for layer in held.layers] == [0, 1, 2, 3]
    assert view.stage_config.num_hidden_layers == 2
    assert held.stage_config.num_hidden_layers == NUM_LAYERS
    assert view.layers_range == LayerRange(1, 3) and held.layers_range == LayerRange(0, 4)


def test_the_held_stage_is_unchanged_after_a_view_ran(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    held = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    ids = prompt(10, config.vocab_size)
    before, before_tokens = greedy_logits([held], ids, DECODE_STEPS)
    views = [held.view(LayerRange(0, 2)), held.view(LayerRange(2, NUM_LAYERS))]
    middle = held.view(LayerRange(1, 3))
    middle(torch.randn(1, 4, config.hidden_size), middle.new_cache())
    greedy_logits(views, ids, DECODE_STEPS)
    after, after_tokens = greedy_logits([held], ids, DECODE_STEPS)
    assert after_tokens == before_tokens
    assert_all_equal(after, before)
    # Its cache still has a slot per held layer, filled by the layer of that index.
    cache = held.new_cache()
    held(ids, cache)
    assert len(cache.layers) == NUM_LAYERS
    assert all(layer.keys.shape[-2] == 10 for layer in cache.layers)


def test_runtime_session_over_part_of_the_held_layers(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    whole = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    front = load(tiny_chat_dir, config, 0, 2)
    runtime = StageRuntime(load(tiny_chat_dir, config, 0, NUM_LAYERS), max_sessions=2)
    runtime.open("s", 64, SamplingParams(temperature=0), layers=LayerRange(2, NUM_LAYERS))
    ids = prompt(8, config.vocab_size)
    expected_logits, expected_tokens = greedy_logits([whole], ids, DECODE_STEPS)
    front_cache = front.new_cache()
    hidden = front(ids, front_cache)  # [1, T, H]
    tokens: list[int] = []
    for step in range(DECODE_STEPS + 1):
        assert hidden.dim() == 3 and hidden.shape[-1] == config.hidden_size
        result = runtime.step("s", hidden, want_token=True)
        assert result.hidden is None and result.token is not None
        assert result.token == int(torch.argmax(expected_logits[step][0]))
        tokens.append(result.token)
        hidden = front(torch.tensor([[result.token]]), front_cache)
    assert tokens[:DECODE_STEPS] == expected_tokens
    assert runtime.cached_tokens == 8 + DECODE_STEPS
    runtime.close("s")
    assert runtime.session_count == 0


def test_runtime_sessions_over_different_ranges_side_by_side(
    tiny_chat_dir: Path, config: PretrainedConfig
) -> None:
    whole = load(tiny_chat_dir, config, 0, NUM_LAYERS)
    runtime = StageRuntime(load(tiny_chat_dir, config, 0, NUM_LAYERS), max_sessions=2)
    greedy = SamplingParams(temperature=0)
    runtime.open("head", 64, None, layers=LayerRange(0, 2))
    runtime.open("all", 64, greedy)  # the whole held range
    ids = prompt(6, config.vocab_size)
    expected = int(torch.argmax(whole(ids, whole.new_cache())[0]))
    head = runtime.step("head", ids, want_token=False)
    assert head.token is None and head.hidden is not None
    assert head.hidden.shape == (1, 6, config.hidden_size)
    assert runtime.step("all", ids, want_token=True).token == expected
    # The head's hidden state feeds a session over the tail of another runtime.
    tail = StageRuntime(load(tiny_chat_dir, config, 1, NUM_LAYERS), max_sessions=1)
    tail.open("tail", 64, greedy, layers=LayerRange(2, NUM_LAYERS))
    assert tail.step("tail", head.hidden, want_token=True).token == expected
