"""safetensors files, read and written one tensor at a time.

`TensorWriter` streams tensors into a file whose header it writes first (the names,
dtypes and shapes are declared up front), so converting or sharding a model holds one
tensor in memory at a time, not the whole model. `TensorReader` reads tensors with plain
reads instead of a memory map: a mapped file's pages count towards the process's resident
memory until it is closed, which would double the peak while a stage builds its own
(packed, fused) copies of the weights. The files are standard safetensors: `safe_open`
and `safetensors.torch.load_file` read them too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from swarmd.dtypes import SAFETENSORS_ITEM
from swarmd.errors import ModelLoadError

_TAGS: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {tag: dtype for dtype, tag in _TAGS.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGN = 8


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's entry in a file header: name, dtype tag and shape."""

    name: str
    tag: str  # safetensors dtype tag, e.g. "BF16"
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, _TAGS[tensor.dtype], tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_ITEM[self.tag]


def read_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    """The parsed JSON header of a safetensors file and the offset its data starts at."""
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= MAX_HEADER_BYTES:
                raise ModelLoadError(f"{path} has no safetensors header")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read the safetensors header of {path}: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has no safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + length


class TensorWriter:
    """Write the tensors declared in `specs`, in that order, with `write`."""

    def __init__(
        self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for spec in specs:
            header[spec.name] = {
                "dtype": spec.tag,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN)
        self._pending = list(specs)
        self._handle: IO[bytes] = path.open("wb")
        self._handle.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self._pending or self._pending[0].name != name:
            expected = self._pending[0].name if self._pending else "nothing"
            raise ModelLoadError(f"tensor {name!r} written where {expected!r} was declared")
        spec = self._pending.pop(0)
        if TensorSpec.of(name, tensor) != spec:
            raise ModelLoadError(f"tensor {name!r} is not the {spec.tag} {spec.shape} declared")
        data = tensor.detach().contiguous().cpu()
        if data.dtype == torch.bfloat16:  # numpy has no bfloat16: write the raw 16-bit words
            data = data.view(torch.int16)
        self._handle.write(data.numpy().tobytes())

    def close(self) -> None:
        self._handle.close()
        if self._pending:
            raise ModelLoadError(f"{len(self._pending)} declared tensors were never written")

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._handle.close()


class TensorReader:
    """Named tensors of one safetensors file, each read on request (no memory map)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._header, self._data_start = read_header(path)
        self._handle: IO[bytes] | None = None

    def names(self) -> list[str]:
        return list(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def spec(self, name: str) -> TensorSpec:
        tag, shape, _ = self._checked(name)
        return TensorSpec(name, tag, shape)

    def get(self, name: str) -> torch.Tensor:
        tag, shape, (start, end) = self._checked(name)
        out = torch.empty(shape, dtype=_DTYPES[tag])
        if out.numel() == 0:
            return out
        handle = self._open()
        try:
            handle.seek(self._data_start + start)
            raw = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
            read = handle.readinto(memoryview(raw.numpy()).cast("B"))
        except OSError as exc:
            raise ModelLoadError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        if read != end - start:
            raise ModelLoadError(f"{self.path} ends inside tensor {name!r}")
        return out

    def _checked(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
        """dtype tag, shape and data offsets of a tensor, every one checked against the
        others before anything is allocated (the header is untrusted input)."""
        info = self._entry(name)
        tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if tag not in _DTYPES:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {tag!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has a bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has bad data offsets")
        spec = TensorSpec(name, str(tag), tuple(shape))
        if offsets[1] - offsets[0] != spec.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has a size its shape denies")
        return str(tag), tuple(shape), (offsets[0], offsets[1])

    def _entry(self, name: str) -> dict[str, object]:
        info = self._header.get(name)
        if not isinstance(info, dict):
            raise ModelLoadError(f"Tensor {name!r} is missing from {self.path}")
        return info

    def _open(self) -> IO[bytes]:
        if self._handle is None:
            try:
                self._handle = self.path.open("rb", buffering=0)
            except OSError as exc:
                raise ModelLoadError(f"Cannot read {self.path}: {exc.strerror or exc}") from exc
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_files(model_dir: Path, only: list[Path] | None = None) -> dict[str, Path]:
    """Which safetensors file holds each tensor of a checkpoint directory.

    `only`: look in these files alone (the shards of a node's range), never the rest.
    """
    index = model_dir / "model.safetensors.index.json"
    if only is None and index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors")) if only is None else only
    if not files:
        raise ModelLoadError(f"No .safetensors files in {model_dir}")
    located: dict[str, Path] = {}
    for file in files:
        for name in read_header(file)[0]:
            located[name] = file
    return located
