"""A GGUF file's weights read in place: the same bits as a converted copy, no weights
written anywhere, and a range-only node touches (and depends on) only its own bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from swarmd.engine.arch import arch_spec
from swarmd.engine.load import load_lean_stage
from swarmd.model.gguf_index import read_index
from swarmd.model.layers import LayerRange
from swarmd.model.loader import load_model, open_tensors, read_config
from swarmd.model.memory import layer_weight_bytes
from swarmd.model.source import ModelSource, resolve_folder, resolve_model
from tests.gguf_files import SHAPES, write_llama_gguf

# Block-type mixes of the files under test: every type swarmd reads.
MIXES = {
    "q4_0": {},
    "q4_1+q8_0": {"attn_v.weight": "Q8_0", "token_embd.weight": "Q4_1", "ffn_up.weight": "Q4_1"},
    "k-quants": {
        "ffn_down.weight": "Q6_K",
        "ffn_up.weight": "Q4_K",
        "ffn_gate.weight": "Q5_K",
        "output.weight": "Q6_K",
    },
    "q5+f16": {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_1", "attn_output.weight": "F16"},
}
PROMPT = torch.tensor([[1, 520, 2432, 314, 5, 77, 99, 1024, 4000]])


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(in place, converted): each file's header is read once per module (its tokenizer
    parse takes seconds), each conversion made once."""
    return tmp_path_factory.mktemp("in-place"), tmp_path_factory.mktemp("converted")


@pytest.fixture(scope="module", params=sorted(MIXES))
def gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return write_llama_gguf(folder / f"{request.param}.gguf", SHAPES["tiny"], MIXES[request.param])


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An all-Q4_0 file (the shape of most GGUFs people run) with a Q6_K down projection."""
    folder = tmp_path_factory.mktemp("plain")
    return write_llama_gguf(folder / "m.gguf", SHAPES["tiny"], {"ffn_down.weight": "Q6_K"})


def _run(stage: object, chunk: torch.Tensor) -> torch.Tensor:
    cache = stage.new_cache(32)  # type: ignore[attr-defined]
    with torch.inference_mode():
        return stage(chunk, cache)  # type: ignore[operator,no-any-return]


def _cache_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def no_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 / Q8_0 held in torch's forms, as a converted copy holds them (not the file's
    blocks, whose kernel rounds otherwise: the test after these two)."""
    monkeypatch.setattr("swarmd.model.loader.blocks_kernel", lambda: False)


def test_in_place_gives_the_bits_of_a_converted_copy(
    gguf: Path, caches: tuple[Path, Path], no_blocks: None
) -> None:
    _same_bits(gguf, caches, "auto")


def test_in_place_under_explicit_weights_gives_the_converted_bits(
    plain: Path, caches: tuple[Path, Path], no_blocks: None
) -> None:
    _same_bits(plain, caches, "int8")


def test_kept_blocks_are_the_files_bytes_and_close_to_the_converted_copy(
    plain: Path, caches: tuple[Path, Path]
) -> None:
    from swarmd.engine import native
    from swarmd.engine.linear import Blocks

    model = load_model(resolve_model(str(plain), caches[0]), None)
    converted = load_model(resolve_folder(str(plain), caches[1]), None)
    stage = model.stage
    kept = [m for b in stage.blocks for m, _ in b.qkv.groups if isinstance(m, Blocks)]  # type: ignore[attr-defined]
    if native.blocks_op() is None:  # a CPU without AVX2: torch's int4 serves, as converted
        assert kept == [] and model.kernels == converted.kernels
        return
    shape = SHAPES["tiny"]
    assert len(kept) == shape.layers and model.kernels == "swarmd+torch"  # Q6_K down: torch
    # q, k and v of a layer fused: the file's Q4_0 rows (q and k un-permuted), 18 bytes
    # per 32 weights, interleaved by 4 rows
    rows = shape.hidden + 2 * shape.kv_heads * (shape.hidden // shape.heads)
    assert kept[0].data.numel() == rows * shape.hidden // 32 * 18
    assert kept[0].code == native.BAND_CODE
    ours = _run(stage, PROMPT).float()
    theirs = _run(converted.stage, PROMPT).float()
    assert torch.isfinite(ours).all()
    # 8-bit activations against bfloat16 ones: close, not equal
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


@pytest.fixture(scope="module")
def k_quants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A K-quant file as llama.cpp's Q4_K_M / Q5_K_M mixes make them."""
    folder = tmp_path_factory.mktemp("k-quants")
    types = {"ffn_down.weight": "Q6_K", "ffn_up.weight": "Q5_K", "output.weight": "Q6_K"}
    return write_llama_gguf(folder / "k.gguf", SHAPES["tiny"], types, default="Q4_K")


def test_k_quant_blocks_are_the_files_bytes_and_close_to_the_converted_copy(
    k_quants: Path, caches: tuple[Path, Path]
) -> None:
    from gguf import GGUFReader

    from swarmd.engine import native
    from swarmd.engine.linear import Blocks

    model = load_model(resolve_model(str(k_quants), caches[0]), None)
    converted = load_model(resolve_folder(str(k_quants), caches[1]), None)
    kept = [m for m in _matrices(model.stage) if isinstance(m, Blocks)]
    if native.blocks_op() is None:  # no AVX2: torch's int4 and int8 serve, as converted
        assert kept == []
        return
    assert {m.qtype for m in kept} == {"Q4_K", "Q5_K"}
    file_bytes = sum(
        int(t.n_bytes)
        for t in GGUFReader(k_quants).tensors
        if t.tensor_type.name in ("Q4_K", "Q5_K") and t.name.startswith("blk.")
    )
    assert sum(m.data.numel() for m in kept) == file_bytes  # the file's bytes, none added
    ours = _run(model.stage, PROMPT).float()
    theirs = _run(converted.stage, PROMPT).float()
    assert torch.isfinite(ours).all()
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def _matrices(stage: object) -> list[object]:
    found = []
    for block in stage.blocks:  # type: ignore[attr-defined]
        for part in vars(block).values():
            groups = getattr(part, "groups", None)
            if groups is not None:
                found.extend(m for m, _ in groups)
    return found


def test_q5_keeps_its_32_levels(tmp_path: Path, no_blocks: None) -> None:
    """Held without the block kernel, a Q5 matrix is int8 per row: within half an int8 step
    of the file's values, where int4 (16 levels a group) would lose a bit of each."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from swarmd.model import quant

    types = {"ffn_up.weight": "Q5_0", "ffn_down.weight": "Q5_1", "ffn_gate.weight": "Q5_K"}
    path = write_llama_gguf(tmp_path / "q5.gguf", SHAPES["tiny"], types)
    source = resolve_model(str(path), tmp_path / "cache")
    file_tensors = {t.name: t for t in GGUFReader(path).tensors}
    with open_tensors(source, LayerRange(0, 4), "auto") as tensors:
        for suffix, name in (
            ("ffn_up", "up_proj"),
            ("ffn_down", "down_proj"),
            ("ffn_gate", "gate_proj"),
        ):
            tensor = file_tensors[f"blk.1.{suffix}.weight"]
            file_values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).float()
            stored = tensors.matrix(f"model.layers.1.mlp.{name}.weight")
            assert quant.stored_format(stored) == "int8", suffix
            held = quant.dequantize(stored)  # type: ignore[arg-type]
            step = file_values.abs().amax(dim=1, keepdim=True) / 127
            assert ((held - file_values).abs() <= step * 0.5001 + 1e-7).all(), suffix


def _same_bits(gguf: Path, caches: tuple[Path, Path], weights: str) -> None:
    in_place = resolve_model(str(gguf), caches[0])
    assert in_place.gguf == gguf.resolve()
    converted = resolve_folder(str(gguf), caches[1], weights)
    for layers in (None, "2:4"):
        a = load_model(in_place, layers, weights)
        b = load_model(converted, layers, weights)
        assert (a.weights, a.dtype_name, a.layers) == (b.weights, b.dtype_name, b.layers)
        if a.layers.start == 0:
            # The table stays in the file (exact rows: test below); the rest is the same bits.
            assert a.stage.embed.rows is not None  # type: ignore[attr-defined]
            b.stage.embed = a.stage.embed  # type: ignore[attr-defined]
            chunk = PROMPT
        else:
            chunk = torch.randn(1, 9, a.hidden_size).to(a.hidden_dtype)
        assert torch.equal(_run(a.stage, chunk), _run(b.stage, chunk))


def test_the_embedding_rows_are_the_files_exactly(gguf: Path, caches: tuple[Path, Path]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from swarmd.engine.stage import ACT

    model = load_model(resolve_model(str(gguf), caches[0]), "0:1")
    table = next(t for t in GGUFReader(str(gguf)).tensors if t.name == "token_embd.weight")
    ids = PROMPT[0]
    expected = torch.from_numpy(dequantize(table.data[ids.numpy()], table.tensor_type))
    assert torch.equal(model.stage.embed(ids), expected.to(ACT))  # type: ignore[attr-defined]


def test_no_weights_are_written(plain: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = load_model(resolve_model(str(plain), cache), None)
    assert torch.isfinite(_run(model.stage, PROMPT).float()).all()
    assert not list(cache.rglob("*.safetensors"))
    # config, tokenizer (SmolLM2's: about 3.5 MB), the index: none of the 20 MB of weights
    assert _cache_bytes(cache) < 0.3 * plain.stat().st_size


def test_the_exact_path_reads_the_file_in_place(tmp_path: Path) -> None:
    gguf = write_llama_gguf(tmp_path / "f32.gguf", SHAPES["tiny"], default="F32")
    in_place = load_model(resolve_model(str(gguf), tmp_path / "a"), "1:4", "fp32", "float32")
    converted = load_model(
        resolve_folder(str(gguf), tmp_path / "b", "fp32"), "1:4", "fp32", "float32"
    )
    assert in_place.backend == converted.backend == "transformers"
    hidden = torch.randn(1, 5, in_place.hidden_size)
    assert torch.equal(_run(in_place.stage, hidden), _run(converted.stage, hidden))


def _spans_of(source: ModelSource, layers: LayerRange) -> set[str]:
    """The GGUF tensors whose bytes loading `layers` read."""
    config = read_config(source)
    tensors = open_tensors(source, layers, "auto")
    try:
        load_lean_stage(tensors, arch_spec(config), layers, "auto", torch.bfloat16)
        spans = set(tensors.spans)  # type: ignore[attr-defined]
    finally:
        tensors.close()
    _, entries = read_index(source.model_dir)
    return {e.name for e in entries if (e.offset, e.nbytes) in spans}


def test_a_range_reads_only_its_own_tensors(plain: Path, caches: tuple[Path, Path]) -> None:
    source = resolve_model(str(plain), caches[0])
    middle = _spans_of(source, LayerRange(1, 3))
    assert middle and all(name.startswith(("blk.1.", "blk.2.")) for name in middle)
    first = _spans_of(source, LayerRange(0, 1))
    # the table is not read at load: a token's row is read when it comes (mapped rows)
    assert "output.weight" not in first and "token_embd.weight" not in first
    assert not any(name.startswith("blk.1.") for name in first)
    last = _spans_of(source, LayerRange(3, 4))
    assert {"output.weight", "output_norm.weight"} <= last and "token_embd.weight" not in last


def test_a_range_does_not_depend_on_other_bytes(
    plain: Path, caches: tuple[Path, Path], tmp_path: Path
) -> None:
    """Garbage written over every tensor outside layers 1:3 changes nothing there."""
    spoiled = tmp_path / "m.gguf"
    shutil.copyfile(plain, spoiled)
    source = resolve_model(str(plain), caches[0])
    _, entries = read_index(source.model_dir)
    with spoiled.open("r+b") as handle:
        for entry in entries:
            if entry.layer not in (1, 2):
                handle.seek(entry.offset)
                handle.write(b"\xff" * entry.nbytes)  # NaN scales, out-of-range blocks
    hidden = torch.randn(1, 7, 256).to(torch.bfloat16)
    clean = load_model(source, "1:3")
    # the same header: the same metadata folder, found without another parse
    dirty = load_model(resolve_model(str(spoiled), caches[0]), "1:3")
    assert dirty.source.model_dir == source.model_dir
    assert torch.equal(_run(clean.stage, hidden), _run(dirty.stage, hidden))


def test_layer_sizes_are_a_converted_copys_less_the_table(
    gguf: Path, caches: tuple[Path, Path]
) -> None:
    """The same bytes per layer as a converted folder holds, but for the embedding table,
    which stays in the file."""
    in_place = resolve_model(str(gguf), caches[0])
    converted = resolve_folder(str(gguf), caches[1])
    shape = SHAPES["tiny"]
    for weights, dtype in (("auto", "bfloat16"), ("int8", "bfloat16"), ("fp32", "float32")):
        ours = layer_weight_bytes(in_place, None, weights, dtype)
        theirs = layer_weight_bytes(converted, None, weights, dtype)
        assert ours[1:] == theirs[1:]
        table = {"auto": 1, "int8": 1, "fp32": 4}[weights] * shape.vocab * shape.hidden
        assert theirs[0] - ours[0] == table


def test_scripted_decode_over_kept_blocks_equals_the_eager_loop(
    plain: Path, caches: tuple[Path, Path]
) -> None:
    """The decode loop runs as TorchScript over the block kernel too: the same bits as the
    eager loop, one row and two at once."""
    from swarmd.model.rows import Row

    stage = load_model(resolve_model(str(plain), caches[0]), None).stage
    runs = []
    for scripted in (True, False):
        stage.scripted_decode = scripted  # type: ignore[attr-defined]
        caches_ = [stage.new_cache(32) for _ in range(2)]
        outs = [_run_into(stage, PROMPT[:, : 5 + i], caches_[i]) for i in range(2)]
        with torch.inference_mode():
            for step in range(4):
                rows = [
                    Row(torch.tensor([[7 + step + i]]), caches_[i]) for i in range(1 + step % 2)
                ]
                outs += stage.forward_many(rows)  # type: ignore[attr-defined]
        runs.append(outs)
    assert stage._decode_loop is not None  # type: ignore[attr-defined]  # it did run scripted
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _run_into(stage: object, chunk: torch.Tensor, cache: object) -> torch.Tensor:
    with torch.inference_mode():
        return stage(chunk, cache)  # type: ignore[operator,no-any-return]
