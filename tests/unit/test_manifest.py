"""The manifest (pure): round trip, content id, every refusal of a hostile manifest,
layer lookups; and the file checks of `shards.py` (hashing, verification, range plans)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmd.errors import ConfigError, ManifestError, ModelLoadError, ShardHashError
from swarmd.model.hashing import hash_file, verify_files
from swarmd.model.layers import LayerRange
from swarmd.model.manifest import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    MIN_CHUNK_BYTES,
    FileEntry,
    Manifest,
    ShardEntry,
    chunk_count,
    parse_manifest,
)
from swarmd.model.shards import even_ranges, parse_ranges

CHUNK = MIN_CHUNK_BYTES
NUM_LAYERS = 30
# name -> size: one partial last chunk, an exact multiple of CHUNK, a sub-chunk file.
SHARD_SIZES = {
    "layers-00000-00010.safetensors": 150_001,
    "layers-00010-00020.safetensors": 2 * CHUNK,
    "layers-00020-00030.safetensors": 140_000,
}
FILE_SIZES = {"tokenizer.json": 70_000, "chat_template.jinja": 1_000}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def entry_for(name: str, data: bytes) -> FileEntry:
    chunks = tuple(sha(data[at : at + CHUNK]) for at in range(0, len(data), CHUNK))
    return FileEntry(name, len(data), sha(data), chunks)


def shard_for(name: str, data: bytes, start: int, end: int) -> ShardEntry:
    entry = entry_for(name, data)
    return ShardEntry(entry.file, entry.bytes, entry.sha256, entry.chunks, start, end)


def make_manifest() -> Manifest:
    files = tuple(entry_for(n, blob(n, size)) for n, size in FILE_SIZES.items())
    shards = tuple(
        shard_for(n, blob(n, size), 10 * i, 10 * i + 10)
        for i, (n, size) in enumerate(SHARD_SIZES.items())
    )
    config = {"model_type": "llama", "num_hidden_layers": NUM_LAYERS, "hidden_size": 64}
    return Manifest(
        "tiny-llama", "llama", config, NUM_LAYERS, "bfloat16", "bf16", CHUNK, files, shards
    )


@pytest.fixture
def manifest() -> Manifest:
    return make_manifest()


def encoded(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def edited(manifest: Manifest, edit: Callable[[dict[str, Any]], object]) -> bytes:
    """The manifest's JSON (without its content id) after `edit` changed it in place."""
    body = copy.deepcopy(manifest.body())
    edit(body)
    return encoded(body)


# --- round trip and content id ----------------------------------------------------------


def test_to_json_parses_back_to_an_equal_manifest(manifest: Manifest) -> None:
    raw = manifest.to_json()
    parsed = parse_manifest(raw)
    assert parsed == manifest
    assert parsed.content_id == manifest.content_id
    assert all(type(s) is ShardEntry for s in parsed.shards)
    assert all(type(f) is FileEntry for f in parsed.files)
    assert json.loads(raw)["content_id"] == manifest.content_id
    assert parsed.to_json() == raw


def test_a_manifest_without_its_content_id_field_is_accepted(manifest: Manifest) -> None:
    assert parse_manifest(encoded(manifest.body())) == manifest


def test_an_empty_file_has_no_chunks_and_round_trips(manifest: Manifest) -> None:
    empty = entry_for("added_tokens.json", b"")
    assert empty.chunks == () and empty.sha256 == sha(b"")
    with_empty = dataclasses.replace(manifest, files=(*manifest.files, empty))
    assert parse_manifest(with_empty.to_json()) == with_empty


def test_content_id_is_stable(manifest: Manifest) -> None:
    again = make_manifest()
    assert again == manifest
    assert again.content_id == manifest.content_id
    assert re.fullmatch(r"[0-9a-f]{64}", manifest.content_id)
    # the config's key order is not part of the identity
    reordered = dict(reversed(list(manifest.config.items())))
    assert dataclasses.replace(manifest, config=reordered).content_id == manifest.content_id


def _other_hash(value: str) -> str:
    return sha(value.encode())


CHANGES: dict[str, Callable[[Manifest], Manifest]] = {
    "model_id": lambda m: dataclasses.replace(m, model_id="tiny-llama-2"),
    "dtype": lambda m: dataclasses.replace(m, dtype="float16"),
    "weights": lambda m: dataclasses.replace(m, weights="int4"),
    "config value": lambda m: dataclasses.replace(m, config={**m.config, "hidden_size": 65}),
    "config key": lambda m: dataclasses.replace(m, config={**m.config, "extra": None}),
    "shard hash": lambda m: dataclasses.replace(
        m,
        shards=(
            dataclasses.replace(m.shards[0], sha256=_other_hash(m.shards[0].sha256)),
            *m.shards[1:],
        ),
    ),
    "shard chunk hash": lambda m: dataclasses.replace(
        m,
        shards=(
            m.shards[0],
            dataclasses.replace(
                m.shards[1], chunks=(m.shards[1].chunks[0], _other_hash(m.shards[1].chunks[1]))
            ),
            m.shards[2],
        ),
    ),
    "file chunk hash": lambda m: dataclasses.replace(
        m,
        files=(
            dataclasses.replace(
                m.files[0], chunks=(_other_hash(m.files[0].chunks[0]), *m.files[0].chunks[1:])
            ),
            *m.files[1:],
        ),
    ),
    "file name": lambda m: dataclasses.replace(
        m, files=(dataclasses.replace(m.files[0], file="tokenizer2.json"), *m.files[1:])
    ),
    "file size": lambda m: dataclasses.replace(
        m, files=(m.files[0], dataclasses.replace(m.files[1], bytes=1_001))
    ),
    "shard layers": lambda m: dataclasses.replace(
        m,
        shards=(
            dataclasses.replace(m.shards[0], end=11),
            dataclasses.replace(m.shards[1], start=11),
            m.shards[2],
        ),
    ),
    "file order": lambda m: dataclasses.replace(m, files=tuple(reversed(m.files))),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_content_id_changes_with_any_field(manifest: Manifest, change: str) -> None:
    changed = CHANGES[change](manifest)
    assert changed != manifest
    assert changed.content_id != manifest.content_id


def test_parse_with_the_expected_id(manifest: Manifest) -> None:
    raw = manifest.to_json()
    assert parse_manifest(raw, expected_id=manifest.content_id) == manifest
    other = CHANGES["dtype"](manifest).content_id
    with pytest.raises(ManifestError, match="the id asked for") as caught:
        parse_manifest(raw, expected_id=other)
    assert manifest.content_id in str(caught.value) and other in str(caught.value)


@pytest.mark.parametrize("claimed", ["0" * 64, "", 5, None, ["x"]])
def test_a_tampered_content_id_field_is_refused(manifest: Manifest, claimed: object) -> None:
    data = json.loads(manifest.to_json())
    data["content_id"] = claimed
    if claimed is None:
        # JSON null is read as "no content id field": nothing to contradict
        assert parse_manifest(encoded(data)) == manifest
        return
    with pytest.raises(ManifestError, match="its own content_id field"):
        parse_manifest(encoded(data))


def test_a_changed_body_with_the_old_content_id_is_refused(manifest: Manifest) -> None:
    data = json.loads(manifest.to_json())
    data["shards"][0]["sha256"] = _other_hash(data["shards"][0]["sha256"])
    with pytest.raises(ManifestError, match="its own content_id field"):
        parse_manifest(encoded(data))


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe{}", b"{'format': 1}", b"[" * 100_000 + b"]" * 100_000],
    ids=["empty", "cut", "not-utf8", "python-dict", "deep-nesting"],
)
def test_not_json_is_refused(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="not JSON"):
        parse_manifest(raw)


@pytest.mark.parametrize("raw", [b"[]", b"42", b'"manifest"', b"null", b"true"])
def test_json_that_is_not_an_object_is_refused(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="not a JSON object"):
        parse_manifest(raw)


def test_a_manifest_over_the_size_limit_is_refused_unread(manifest: Manifest) -> None:
    raw = manifest.to_json()
    padded = raw + b" " * (MAX_MANIFEST_BYTES - len(raw))
    assert parse_manifest(padded) == manifest  # at the limit: whitespace is fine
    with pytest.raises(ManifestError, match=f"over {MAX_MANIFEST_BYTES}"):
        parse_manifest(padded + b" ")
    with pytest.raises(ManifestError, match="over"):
        parse_manifest(b"\xff" * (MAX_MANIFEST_BYTES + 1))  # not even decoded


def _set(path: tuple[object, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        target: Any = body
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value

    return edit


def _drop(path: tuple[object, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        target: Any = body
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]

    return edit


KEY_EDITS = {
    "unknown top key": _set(("extra",), 1),
    "missing top key": _drop(("dtype",)),
    "unknown file key": _set(("files", 0, "mode"), "rw"),
    "missing file key": _drop(("files", 1, "chunks")),
    "unknown shard key": _set(("shards", 1, "layers"), [10, 20]),
    "missing shard start": _drop(("shards", 0, "start")),
    "missing shard end": _drop(("shards", 2, "end")),
    "file entry with shard keys": _set(("files", 0, "start"), 0),
}


@pytest.mark.parametrize("edit", list(KEY_EDITS))
def test_unknown_or_missing_keys_are_refused(manifest: Manifest, edit: str) -> None:
    with pytest.raises(ManifestError, match=r"missing .*unknown"):
        parse_manifest(edited(manifest, KEY_EDITS[edit]))


@pytest.mark.parametrize(
    "value", ["swarmd-manifest/1", "swarmd-manifest/3", "", 1, None, ["swarmd-manifest/2"]]
)
def test_a_wrong_format_is_refused(manifest: Manifest, value: object) -> None:
    with pytest.raises(ManifestError, match="format"):
        parse_manifest(edited(manifest, _set(("format",), value)))
    assert MANIFEST_FORMAT == "swarmd-manifest/2"


BAD_NAMES = [
    "../x",
    "..",
    ".",
    "a/b",
    "/etc/passwd",
    "a\\b",
    ".hidden",
    "",
    "x" * 200,
    "x" * 129,
    "-rf",
    "_x",
    "a b",
    "a\x00b",
    "é.json",
    "tokenizer.json\n",
    7,
    None,
]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("where", [("files", 0), ("shards", 1)])
def test_bad_file_names_are_refused(
    manifest: Manifest, name: object, where: tuple[str, int]
) -> None:
    with pytest.raises(ManifestError, match="not a plain file name"):
        parse_manifest(edited(manifest, _set((*where, "file"), name)))


def test_names_of_128_plain_characters_are_accepted(manifest: Manifest) -> None:
    longest = "a" * 124 + ".bin"
    raw = edited(manifest, _set(("files", 1, "file"), longest))
    assert parse_manifest(raw).files[1].file == longest


@pytest.mark.parametrize(
    "edit",
    [
        _set(("files", 1, "file"), "tokenizer.json"),
        _set(("shards", 2, "file"), "layers-00000-00010.safetensors"),
        _set(("shards", 0, "file"), "tokenizer.json"),
    ],
    ids=["two-files", "two-shards", "file-and-shard"],
)
def test_duplicate_names_are_refused(manifest: Manifest, edit: Callable[..., None]) -> None:
    with pytest.raises(ManifestError, match="one file twice"):
        parse_manifest(edited(manifest, edit))


@pytest.mark.parametrize("where", [("files", 0), ("shards", 2)])
def test_the_manifest_listing_itself_is_refused(manifest: Manifest, where: tuple) -> None:
    with pytest.raises(ManifestError, match=f"lists {MANIFEST_FILE}"):
        parse_manifest(edited(manifest, _set((*where, "file"), MANIFEST_FILE)))


def _bad_hexes(good: str) -> list[object]:
    return [good.upper(), good[:-1] + "g", good[:-1], good + "0", "", None, 12, "0x" + good[2:]]


@pytest.mark.parametrize("index", range(8))
def test_a_bad_sha256_is_refused(manifest: Manifest, index: int) -> None:
    bad = _bad_hexes(manifest.shards[0].sha256)[index]
    with pytest.raises(ManifestError, match="sha256' is not 64 lowercase hex"):
        parse_manifest(edited(manifest, _set(("shards", 0, "sha256"), bad)))


@pytest.mark.parametrize("index", range(8))
def test_a_bad_chunk_hash_is_refused(manifest: Manifest, index: int) -> None:
    bad = _bad_hexes(manifest.files[0].chunks[1])[index]
    with pytest.raises(ManifestError, match="chunk' is not 64 lowercase hex"):
        parse_manifest(edited(manifest, _set(("files", 0, "chunks", 1), bad)))


CHUNK_LIST_EDITS = {
    "one missing": lambda body: body["shards"][0]["chunks"].pop(),
    "one extra": lambda body: body["shards"][1]["chunks"].append("0" * 64),
    "none": _set(("files", 0, "chunks"), []),
    "empty file with a chunk": lambda body: body["files"][1].update(bytes=0),
    "size past the last chunk": _set(("shards", 1, "bytes"), 2 * CHUNK + 1),
    "a string": _set(("shards", 2, "chunks"), "0" * 64),
    "an object": _set(("shards", 2, "chunks"), {"0": "0" * 64}),
}


@pytest.mark.parametrize("edit", list(CHUNK_LIST_EDITS))
def test_a_wrong_number_of_chunk_hashes_is_refused(manifest: Manifest, edit: str) -> None:
    with pytest.raises(ManifestError, match="chunk hashes expected"):
        parse_manifest(edited(manifest, CHUNK_LIST_EDITS[edit]))


INT_FIELDS = [
    ("num_layers",),
    ("chunk_bytes",),
    ("files", 0, "bytes"),
    ("shards", 0, "bytes"),
    ("shards", 1, "start"),
    ("shards", 0, "end"),
]


@pytest.mark.parametrize("path", INT_FIELDS, ids=lambda path: "-".join(map(str, path)))
@pytest.mark.parametrize("value", [True, False, 10.0, "10", None])
def test_a_non_integer_where_an_integer_is_expected_is_refused(
    manifest: Manifest, path: tuple[object, ...], value: object
) -> None:
    with pytest.raises(ManifestError, match="is not an integer in"):
        parse_manifest(edited(manifest, _set(path, value)))


def test_bool_layer_counts_are_refused_even_where_they_equal_the_number() -> None:
    """`True == 1`: a 1-layer model whose num_layers is `true` must still be refused."""
    data = blob("one", 10)
    one = Manifest(
        "one",
        "llama",
        {"model_type": "llama", "num_hidden_layers": 1},
        1,
        "float32",
        "fp32",
        CHUNK,
        (),
        (shard_for("layers.bin", data, 0, 1),),
    )
    assert parse_manifest(one.to_json()) == one
    for path in (("num_layers",), ("shards", 0, "end")):
        with pytest.raises(ManifestError, match="is not an integer in"):
            parse_manifest(edited(one, _set(path, True)))
    with pytest.raises(ManifestError, match="is not an integer in"):
        parse_manifest(edited(one, _set(("shards", 0, "start"), False)))


LAYOUT_EDITS = {
    "gap": lambda body: body["shards"][1].update(start=11),
    "overlap": lambda body: body["shards"][1].update(start=9),
    "short of num_layers": lambda body: body["shards"].pop(),
    "past num_layers": lambda body: body["shards"][2].update(end=31),
    "out of order": lambda body: body["shards"].reverse(),
    "not from layer 0": lambda body: body["shards"][0].update(start=1),
    "empty range": lambda body: body["shards"][1].update(end=10),
    "backwards range": lambda body: body["shards"][1].update(start=20, end=10),
    "no shards": _set(("shards",), []),
    "a shard twice": lambda body: body["shards"].insert(1, copy.deepcopy(body["shards"][0])),
}


@pytest.mark.parametrize("edit", list(LAYOUT_EDITS))
def test_shards_must_tile_the_layers(manifest: Manifest, edit: str) -> None:
    with pytest.raises(ManifestError, match="must cover layers 0:30 in order"):
        parse_manifest(edited(manifest, LAYOUT_EDITS[edit]))


@pytest.mark.parametrize(
    "value", [0, -1, MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1, 1 << 40], ids=str
)
def test_chunk_bytes_out_of_range_is_refused(manifest: Manifest, value: int) -> None:
    with pytest.raises(ManifestError, match=r"chunk_bytes' is not an integer in 65536\.\."):
        parse_manifest(edited(manifest, _set(("chunk_bytes",), value)))


@pytest.mark.parametrize("value", [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES])
def test_chunk_bytes_at_the_limits_are_accepted(value: int) -> None:
    data = blob("edge", 3 * value // 2)
    entry = FileEntry(
        "w.bin",
        len(data),
        sha(data),
        tuple(sha(data[at : at + value]) for at in range(0, len(data), value)),
    )
    shard = ShardEntry(entry.file, entry.bytes, entry.sha256, entry.chunks, 0, 1)
    config = {"model_type": "qwen2", "num_hidden_layers": 1}
    one = Manifest("edge", "qwen2", config, 1, "float16", "fp16", value, (), (shard,))
    assert parse_manifest(one.to_json()) == one


CONFIG_EDITS = {
    "model_type mismatch": _set(("config", "model_type"), "qwen2"),
    "model_type missing": _drop(("config", "model_type")),
    "architecture mismatch": _set(("architecture",), "mistral"),
    "num_hidden_layers mismatch": _set(("config", "num_hidden_layers"), 31),
    "num_hidden_layers missing": _drop(("config", "num_hidden_layers")),
    "config not an object": _set(("config",), [["model_type", "llama"]]),
}


@pytest.mark.parametrize("edit", list(CONFIG_EDITS))
def test_a_config_that_contradicts_the_manifest_is_refused(manifest: Manifest, edit: str) -> None:
    with pytest.raises(ManifestError, match="config"):
        parse_manifest(edited(manifest, CONFIG_EDITS[edit]))


OTHER_EDITS = {
    "model_id empty": _set(("model_id",), ""),
    "model_id too long": _set(("model_id",), "m" * 129),
    "model_id not text": _set(("model_id",), 3),
    "dtype empty": _set(("dtype",), ""),
    "weights empty": _set(("weights",), ""),
    "weights unknown": _set(("weights",), "int3"),
    "weights half known": _set(("weights",), "int4+q2"),
    "architecture not text": _set(("architecture",), None),
    "zero layers": lambda body: body.update(num_layers=0),
    "too many layers": lambda body: body.update(num_layers=10_001),
    "negative size": _set(("files", 1, "bytes"), -1),
    "files not a list": _set(("files",), {"tokenizer.json": {}}),
    "shards not a list": _set(("shards",), None),
    "file entry not an object": _set(("files", 0), "tokenizer.json"),
    "shard entry not an object": _set(("shards", 0), ["layers.bin"]),
    "too many files": lambda body: body.update(files=[{}] * 4097),
}


@pytest.mark.parametrize("edit", list(OTHER_EDITS))
def test_other_bad_fields_are_refused(manifest: Manifest, edit: str) -> None:
    with pytest.raises(ManifestError):
        parse_manifest(edited(manifest, OTHER_EDITS[edit]))


# --- layers and chunks ------------------------------------------------------------------


def test_shards_for_takes_every_overlapping_shard(manifest: Manifest) -> None:
    a, b, c = manifest.shards

    def names(start: int, end: int) -> list[str]:
        return [s.file for s in manifest.shards_for(LayerRange(start, end))]

    assert names(5, 15) == [a.file, b.file]
    assert names(0, 30) == [a.file, b.file, c.file]
    assert names(10, 20) == [b.file]  # touching a shard's edge is not overlapping it
    assert names(9, 10) == [a.file]
    assert names(9, 11) == [a.file, b.file]
    assert names(29, 30) == [c.file]
    assert names(19, 21) == [b.file, c.file]


def test_files_for_adds_the_common_files_first(manifest: Manifest) -> None:
    a, b, _ = manifest.shards
    assert manifest.files_for(LayerRange(5, 15)) == [*manifest.files, a, b]
    assert manifest.files_for(LayerRange(20, 21)) == [*manifest.files, manifest.shards[2]]


def test_entry_finds_files_and_shards_by_name(manifest: Manifest) -> None:
    assert manifest.entry("tokenizer.json") == manifest.files[0]
    assert manifest.entry(manifest.shards[1].file) == manifest.shards[1]
    assert manifest.entry(MANIFEST_FILE) is None
    assert manifest.entry("../tokenizer.json") is None


def test_layer_bytes_spreads_each_shard_over_its_layers(manifest: Manifest) -> None:
    per_layer = manifest.layer_bytes()
    assert len(per_layer) == NUM_LAYERS
    for shard in manifest.shards:
        mine = per_layer[shard.start : shard.end]
        assert sum(mine) == shard.bytes
        assert max(mine) - min(mine) <= 1
    assert per_layer[0] == 15_001 and per_layer[1] == 15_000  # the remainder goes first
    assert sum(per_layer) == sum(SHARD_SIZES.values())


def test_chunk_span_every_chunk_full_but_the_last(manifest: Manifest) -> None:
    partial, exact, _ = manifest.shards
    assert len(partial.chunks) == 3
    assert [partial.chunk_span(i, CHUNK) for i in range(3)] == [
        (0, CHUNK),
        (CHUNK, CHUNK),
        (2 * CHUNK, 150_001 - 2 * CHUNK),
    ]
    assert [exact.chunk_span(i, CHUNK) for i in range(2)] == [(0, CHUNK), (CHUNK, CHUNK)]
    small = manifest.files[1]
    assert small.chunk_span(0, CHUNK) == (0, 1_000)
    spans = [partial.chunk_span(i, CHUNK) for i in range(len(partial.chunks))]
    assert sum(length for _, length in spans) == partial.bytes


def test_chunk_count() -> None:
    assert chunk_count(0, CHUNK) == 0
    assert chunk_count(1, CHUNK) == 1
    assert chunk_count(CHUNK, CHUNK) == 1
    assert chunk_count(CHUNK + 1, CHUNK) == 2
    assert chunk_count(1 << 40, MAX_CHUNK_BYTES) == (1 << 40) // MAX_CHUNK_BYTES


# --- files on disk ----------------------------------------------------------------------


def write_model(folder: Path) -> Manifest:
    manifest = make_manifest()
    for name, size in (*FILE_SIZES.items(), *SHARD_SIZES.items()):
        (folder / name).write_bytes(blob(name, size))
    return manifest


def test_hash_file_gives_the_whole_and_chunk_hashes(tmp_path: Path) -> None:
    manifest = write_model(tmp_path)
    for entry in (*manifest.files, *manifest.shards):
        assert hash_file(tmp_path / entry.file, CHUNK) == (entry.sha256, entry.chunks)
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file(tmp_path / "empty", CHUNK) == (sha(b""), ())


def test_verify_files_accepts_matching_files(tmp_path: Path) -> None:
    manifest = write_model(tmp_path)
    verify_files(tmp_path, manifest.files_for(LayerRange(0, NUM_LAYERS)))


def test_verify_files_names_the_file_and_both_hashes(tmp_path: Path) -> None:
    manifest = write_model(tmp_path)
    shard = manifest.shards[1]
    path = tmp_path / shard.file
    data = bytearray(path.read_bytes())
    data[CHUNK + 7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardHashError) as caught:
        verify_files(tmp_path, manifest.files_for(LayerRange(0, NUM_LAYERS)))
    error = caught.value
    assert error.path == str(path)
    assert error.expected == shard.sha256
    assert error.actual == sha(bytes(data))
    message = str(error)
    assert str(path) in message and shard.sha256 in message and sha(bytes(data)) in message
    # a range that does not need the changed shard still verifies
    verify_files(tmp_path, manifest.files_for(LayerRange(0, 10)))


def test_verify_files_refuses_a_missing_file(tmp_path: Path) -> None:
    manifest = write_model(tmp_path)
    (tmp_path / manifest.shards[2].file).unlink()
    with pytest.raises(ModelLoadError, match="missing") as caught:
        verify_files(tmp_path, manifest.shards)
    assert not isinstance(caught.value, ShardHashError)
    assert manifest.shards[2].file in str(caught.value)


def test_verify_files_refuses_a_truncated_file(tmp_path: Path) -> None:
    manifest = write_model(tmp_path)
    path = tmp_path / manifest.files[0].file
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ShardHashError):
        verify_files(tmp_path, manifest.files)


# --- range plans ------------------------------------------------------------------------


def sizes(ranges: list[LayerRange]) -> list[int]:
    return [r.size for r in ranges]


def test_even_ranges() -> None:
    assert even_ranges(30, 3) == [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
    assert sizes(even_ranges(10, 3)) == [4, 3, 3]
    assert even_ranges(10, 3)[-1].end == 10
    assert sizes(even_ranges(5, 5)) == [1] * 5
    assert even_ranges(7, 1) == [LayerRange(0, 7)]
    for layers, stages in ((30, 4), (31, 7), (10_000, 3)):
        ranges = even_ranges(layers, stages)
        assert [r.start for r in ranges[1:]] == [r.end for r in ranges[:-1]]
        assert ranges[0].start == 0 and ranges[-1].end == layers
        assert max(sizes(ranges)) - min(sizes(ranges)) <= 1


@pytest.mark.parametrize("stages", [0, -1, 11])
def test_even_ranges_refuses_impossible_stage_counts(stages: int) -> None:
    with pytest.raises(ConfigError, match="--stages"):
        even_ranges(10, stages)


def test_parse_ranges() -> None:
    tiles = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
    assert parse_ranges("0:10,10:20,20:30", 30) == tiles
    assert parse_ranges(":10, 10:20 ,20:", 30) == tiles
    assert parse_ranges("0:30,", 30) == [LayerRange(0, 30)]


@pytest.mark.parametrize(
    "text",
    [
        "0:10,11:30",  # gap
        "0:10,9:30",  # overlap
        "0:10,10:20",  # short of the end
        "10:30,0:10",  # out of order
        "0:31",  # past the model
        "0:10,10:10,10:30",  # empty range
        "a:b",
        "10",
        "0-30",
        "",
        ",",
        "-1:30",
    ],
)
def test_parse_ranges_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_ranges(text, 30)
