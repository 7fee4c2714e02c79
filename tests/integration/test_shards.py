"""`swarmd shard` round trips: shards of a GGUF file and of a Hugging Face folder give the
original model's logits; verified loading refuses a changed byte and reads only its range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from swarmd.cli import app
from swarmd.errors import ModelLoadError, ShardHashError
from swarmd.model.hashing import file_sha256
from swarmd.model.layers import LayerRange
from swarmd.model.loader import LoadedModel, load_model
from swarmd.model.manifest import MANIFEST_FILE
from swarmd.model.shards import ShardPlan, write_shards
from swarmd.model.source import EMBEDDED_MODEL_ID, resolve_model

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}


def tiny_hf_dir(out: Path, tied: bool, tokenizer_from: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def reference_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids, logits_to_keep=1).logits[:, -1, :]  # [1, V]


def chained_logits(stages: list[LoadedModel], ids: torch.Tensor) -> torch.Tensor:
    hidden = ids
    for model in stages:
        hidden = model.stage(hidden, model.stage.new_cache(64))
    return hidden  # [1, V] from the last stage


def shard_stages(out: Path, ranges: list[str]) -> list[LoadedModel]:
    source = resolve_model(str(out), out)
    assert source.manifest is not None
    return [load_model(source, r) for r in ranges]


def prompt(vocab: int, length: int = 14) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied", [True, False])
def test_shards_of_a_hugging_face_folder_give_its_logits(
    tmp_path: Path, tied: bool, smollm_dir: Path
) -> None:
    source = tiny_hf_dir(tmp_path / "hf", tied, smollm_dir)
    ranges = (LayerRange(0, 2), LayerRange(2, 5), LayerRange(5, 6))
    manifest = write_shards(ShardPlan("tiny", source, ranges, tmp_path / "out", chunk_bytes=65536))
    assert [s.layers for s in manifest.shards] == list(ranges)
    stages = shard_stages(tmp_path / "out", ["0:2", "2:5", "5:6"])
    ids = prompt(TINY["vocab_size"])
    expected = reference_logits(source, ids)
    got = chained_logits(stages, ids)
    # A head read from its own tensor may take another matmul path: one ulp at most.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert int(got.argmax()) == int(expected.argmax())
    # A middle shard holds neither embeddings nor head; the last one has its own head.
    assert stages[1].stage.embed is None and stages[1].stage.lm_head is None
    assert stages[2].stage.lm_head is not None and stages[0].stage.embed is not None


def _shard_embedded(out: Path, cache_dir: Path, *extra: str) -> dict[str, object]:
    args = ["shard", EMBEDDED_MODEL_ID, "--stages", "3", "--out", str(out), *extra]
    result = CliRunner().invoke(app, [*args, "--cache-dir", str(cache_dir)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert [(s["start"], s["end"]) for s in manifest["shards"]] == [(0, 10), (10, 20), (20, 30)]
    assert manifest["model_id"] == EMBEDDED_MODEL_ID
    assert manifest["content_id"] in result.output
    assert {"tokenizer.json", "chat_template.jinja"} <= {f["file"] for f in manifest["files"]}
    return manifest  # type: ignore[no-any-return]


def test_fp32_shards_of_the_embedded_gguf_give_transformers_logits(
    smollm_fp32_dir: Path, test_cache_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "smol"
    manifest = _shard_embedded(out, test_cache_dir, "--weights", "fp32")
    assert manifest["weights"] == "fp32"
    ids = prompt(49152, 20)
    # The fp32 folder is the GGUF as transformers reads it (bit-identical reload).
    expected = reference_logits(smollm_fp32_dir, ids)
    stages = shard_stages(out, ["0:10", "10:20", "20:30"])
    assert {s.backend for s in stages} == {"transformers"}
    got = chained_logits(stages, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert int(got.argmax()) == int(expected.argmax())


def test_int4_shards_of_the_embedded_gguf_chain_to_the_whole_model(
    smollm_dir: Path, test_cache_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "smol"
    manifest = _shard_embedded(out, test_cache_dir)  # the file's own format: int4
    assert manifest["weights"] == "int4"
    sizes = [s["bytes"] for s in manifest["shards"]]  # type: ignore[index]
    # int4 layers, an int8 table in the first shard and its copy (the head) in the last:
    # not the 540 MB of float32 of a float32 split.
    assert sum(sizes) < 150e6
    ids = prompt(49152, 20)
    whole = load_model(resolve_model(str(smollm_dir), smollm_dir), None)
    assert whole.backend == "engine" and whole.weights == "int4"
    stages = shard_stages(out, ["0:10", "10:20", "20:30"])
    assert {(s.backend, s.weights, s.dtype_name) for s in stages} == {
        (whole.backend, whole.weights, whole.dtype_name)
    }
    # A hidden state leaves a stage in float32 exactly as the next layer would take it.
    assert torch.equal(chained_logits(stages, ids), chained_logits([whole], ids))


def test_int4_shards_of_a_float32_folder_equal_that_folder_loaded_as_int4(
    tmp_path: Path, smollm_dir: Path
) -> None:
    source = tiny_hf_dir(tmp_path / "hf", True, smollm_dir)
    ranges = (LayerRange(0, 3), LayerRange(3, 6))
    plan = ShardPlan("tiny", source, ranges, tmp_path / "out", weights="int4")
    manifest = write_shards(plan)
    assert manifest.weights == "int4"
    stages = shard_stages(tmp_path / "out", ["0:3", "3:6"])
    whole = load_model(resolve_model(str(source), source), None, "int4")
    ids = prompt(TINY["vocab_size"])
    assert torch.equal(chained_logits(stages, ids), chained_logits([whole], ids))


def test_a_flipped_byte_is_refused_with_both_hashes(tmp_path: Path, smollm_dir: Path) -> None:
    source = tiny_hf_dir(tmp_path / "hf", True, smollm_dir)
    out = tmp_path / "out"
    manifest = write_shards(ShardPlan("tiny", source, (LayerRange(0, 3), LayerRange(3, 6)), out))
    shard = out / manifest.shards[1].file
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    src = resolve_model(str(out), out)
    with pytest.raises(ShardHashError) as caught:
        load_model(src, "3:6")
    message = str(caught.value)
    assert str(shard) in message
    assert manifest.shards[1].sha256 in message
    assert file_sha256(shard) in message
    load_model(src, "0:3")  # the other shard is untouched and still loads


def test_a_node_reads_only_the_shards_of_its_range(tmp_path: Path, smollm_dir: Path) -> None:
    source = tiny_hf_dir(tmp_path / "hf", True, smollm_dir)
    out = tmp_path / "out"
    ranges = (LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6))
    manifest = write_shards(ShardPlan("tiny", source, ranges, out))
    (out / manifest.shards[0].file).unlink()
    (out / manifest.shards[2].file).unlink()
    middle = load_model(resolve_model(str(out / MANIFEST_FILE), out), "2:4")
    assert middle.layers == LayerRange(2, 4) and middle.source.content_id == manifest.content_id
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(resolve_model(str(out), out), "1:3")


def test_shard_refuses_a_bad_split_and_a_used_folder(tmp_path: Path, smollm_dir: Path) -> None:
    source = tiny_hf_dir(tmp_path / "hf", True, smollm_dir)
    runner = CliRunner()
    for args, why in (
        (["--ranges", "0:2,3:6"], "3:6 where layer 2 comes next"),
        (["--ranges", "0:2,2:5"], "end at layer 5"),
        (["--stages", "7"], "1..6"),
        (["--stages", "2", "--ranges", "0:6"], "either"),
    ):
        result = runner.invoke(app, ["shard", str(source), "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 2 and why in result.output, result.output
    used = tmp_path / "used"
    used.mkdir()
    (used / "a").write_text("x")
    result = runner.invoke(app, ["shard", str(source), "--stages", "2", "--out", str(used)])
    assert result.exit_code == 2 and "not empty" in result.output
    shutil.rmtree(used)
