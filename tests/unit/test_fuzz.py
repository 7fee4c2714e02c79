"""A short run of bench/fuzz.py: every decoder of untrusted input, 1,000 inputs each.

Only the documented errors come out, no input takes 100 ms, none allocates 64 MiB (the
full run, 100,000 inputs a decoder, is `python bench/fuzz.py`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import trio

INPUTS = 1000
TARGETS = ("frames", "stage-wire", "records", "manifest", "file-rpc", "rpc-reply", "api-json")


def _load_fuzz() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("swarmd_bench_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    limits = {"max_ms": 100.0, "max_input_bytes": 64 << 20, "sample": 16}
    return {name: figures for name, figures, _ in fuzz.run_all(INPUTS, 14, **limits)}


def test_every_decoder_is_fuzzed(results: dict[str, object]) -> None:
    assert set(results) == set(TARGETS)


@pytest.mark.parametrize("name", TARGETS)
def test_a_decoder_raises_only_its_documented_errors_fast_and_small(
    results: dict[str, object], name: str
) -> None:
    figures = results[name]
    assert figures.inputs == INPUTS
    assert figures.findings == []
    assert figures.slowest_ms < 100.0
    assert 0 < figures.peak_bytes < 64 << 20
    # The inputs reach past the first check: some are accepted, some refused.
    refused = sum(n for kind, n in figures.errors.items() if kind != "(accepted)")
    assert figures.errors["(accepted)"] > 0 and refused > INPUTS // 10


def test_a_finding_is_reported_with_its_input() -> None:
    def run(data: bytes) -> object:
        if data.startswith(b"\x81"):
            raise KeyError("not a documented error")
        return None

    target = fuzz.Target("probe", [{"a": 1}], fuzz._pack, run, (ValueError,))

    figures = trio.run(fuzz.fuzz_target, target, 200, 0)
    assert figures.findings and "KeyError" in figures.findings[0]
    assert "input 81" in figures.findings[0]  # the input, in hex
