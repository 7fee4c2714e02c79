"""Prompt chunks sized to what a held model computes within a step's time limit."""

from __future__ import annotations

from types import SimpleNamespace

from swarmd.config import Config
from swarmd.node import MIN_PREFILL_CHUNK, prefill_chunk


def model(token_s: float, name: str = "m") -> SimpleNamespace:
    return SimpleNamespace(model_id=name, prompt_token_s=token_s)


def test_a_fast_model_keeps_the_configured_chunk() -> None:
    config = Config(prefill_chunk_tokens=256, step_timeout_s=60.0)
    assert prefill_chunk(config, [model(0.003)]) == 256  # 0.8 s a chunk
    assert prefill_chunk(config, []) == 256  # a gateway: nothing measured


def test_a_slow_model_gets_chunks_that_fit_a_quarter_of_the_step() -> None:
    config = Config(prefill_chunk_tokens=256, step_timeout_s=60.0)
    # an 8B K-quant file on 2 cores: 0.59 s a prompt token, 200 tokens took 118 s
    chunk = prefill_chunk(config, [model(0.003, "small"), model(0.59, "big")])
    assert chunk == 25 and chunk * 0.59 <= 60.0 / 4
    assert prefill_chunk(Config(step_timeout_s=120.0), [model(0.59)]) == 50


def test_the_chunk_never_falls_below_the_floor() -> None:
    config = Config(prefill_chunk_tokens=256, step_timeout_s=60.0)
    assert prefill_chunk(config, [model(10.0)]) == MIN_PREFILL_CHUNK
    assert prefill_chunk(Config(prefill_chunk_tokens=8), [model(10.0)]) == 8
