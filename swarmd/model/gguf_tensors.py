"""A GGUF file's weights read in place: `GgufTensors` gives each tensor by its Hugging
Face checkpoint name, in the form a stage holds it, straight from a read-only memory map
of the file. Nothing is written: a node's weights are the file's bytes of its own layers
(plus the embeddings on a first stage and the head on a last), packed for the kernels in
memory as `engine.load` reads them, one tensor at a time.

What each tensor becomes follows `gguf_convert.plan` (the same rules as a converted
folder, so both give the same bits): Q4_0 / Q4_1 / Q4_K blocks are int4 exactly, other
block types requantized once, floats kept. `spans` records every byte range read, so a
test can prove that a range-only node touched only its range.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmd.errors import ModelLoadError
from swarmd.model import quant
from swarmd.model.gguf_convert import Plan, check_tensor_types, plan, stored_matrix
from swarmd.model.gguf_index import GgufEntry, read_index, tensor_data


class GgufTensors:
    """The tensors of one GGUF file under `weights` (auto or a format), each read when
    asked for. `meta`: the model's metadata folder (config.json and the tensor index)."""

    def __init__(self, path: Path, meta: Path, weights: str, keep_blocks: bool = False) -> None:
        architecture, entries = read_index(meta)
        check_tensor_types(entries)
        config: dict[str, Any] = json.loads((meta / "config.json").read_text())
        self.path = path
        self._entries = {e.name: e for e in entries}
        self._plans = {p.name: p for p in plan(entries, config, architecture, weights)}
        self._file: mmap.mmap | None = _map_file(path)
        self._map: np.ndarray | None = np.frombuffer(self._file, dtype=np.uint8)
        self.spans: list[tuple[int, int]] = []  # (offset, length) of every tensor read
        # Q4_0 / Q8_0 matrices as the file's blocks (`quant.Blocks`), for a kernel that
        # reads them; set by the loader where that kernel runs.
        self.keep_blocks = keep_blocks

    def __contains__(self, name: str) -> bool:
        return name in self._plans

    def entry(self, name: str) -> GgufEntry:
        return self._entries[self._plan(name).gguf_name]

    def formats_of_layers(self, start: int, end: int) -> set[str]:
        """The formats the layer matrices of blocks [start, end) are held in."""
        return {
            p.fmt
            for p in self._plans.values()
            if len(p.shape) == 2
            and (layer := self.entry(p.name).layer) is not None
            and start <= layer < end
        }

    def matrix(self, name: str) -> quant.Stored:
        plan_ = self._plan(name)
        entry = self._entries[plan_.gguf_name]
        if self._map is None:
            raise ModelLoadError(f"{self.path} is closed")
        data = tensor_data(self._map, entry)
        self.spans.append((entry.offset, entry.nbytes))
        try:
            return stored_matrix(plan_, data, self.keep_blocks)
        finally:
            del data
            self._release(entry)

    def rows(self, name: str) -> MappedRows | None:
        """Matrix `name` as rows read from the file on demand (the embedding table: a
        token reads one row), where its plan keeps it as it is in the file (no
        permutation, no fix-up) and gguf can decode its type; else None."""
        plan_ = self._plan(name)
        if plan_.permute_heads or plan_.minus_one or len(plan_.shape) != 2:
            return None
        return MappedRows(self.path, self._entries[plan_.gguf_name])

    def get(self, name: str) -> torch.Tensor:
        stored = self.matrix(name)
        if not isinstance(stored, torch.Tensor):
            raise ModelLoadError(f"GGUF tensor for '{name}' is a quantized matrix, not a vector")
        return stored

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._plans else None

    def close(self) -> None:
        # Unmapping the file: its pages stop counting in this process.
        self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _release(self, entry: GgufEntry) -> None:
        """Drop a tensor's file pages from this process once it is held in its own form:
        loading then peaks at what is held plus one tensor, not plus the whole range. The
        pages stay in the page cache for the next start."""
        if self._file is None:
            return
        start = entry.offset - entry.offset % mmap.PAGESIZE
        self._file.madvise(mmap.MADV_DONTNEED, start, entry.offset + entry.nbytes - start)

    def __enter__(self) -> GgufTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, name: str) -> Plan:
        found = self._plans.get(name)
        if found is None:
            raise ModelLoadError(f"Tensor '{name}' is missing from {self.path.name}")
        return found


def _map_file(path: Path, offset: int = 0, length: int = 0) -> mmap.mmap:
    try:
        with path.open("rb") as handle:
            return mmap.mmap(handle.fileno(), length, access=mmap.ACCESS_READ, offset=offset)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot map the GGUF file {path}: {exc}") from exc


class MappedRows:
    """Rows of one GGUF matrix, decoded to float32 when asked for: an embedding table that
    stays in the file (its pages are the kernel's to drop) instead of a copy in memory."""

    def __init__(self, path: Path, entry: GgufEntry) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.qtype = GGMLQuantizationType[entry.qtype]
        block, size = GGML_QUANT_SIZES[self.qtype]
        self.shape = entry.shape
        self.row_bytes = entry.shape[1] // block * size
        start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
        self._file = _map_file(path, start, entry.offset + entry.nbytes - start)
        skip = entry.offset - start
        self._rows = np.frombuffer(self._file, dtype=np.uint8)[skip:].reshape(
            entry.shape[0], self.row_bytes
        )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [*ids.shape, K]: the rows of `ids` as the file's blocks decode."""
        from gguf.quants import dequantize

        flat = ids.reshape(-1).numpy()
        raw = self._rows[flat]  # a copy of just these rows
        if self.qtype.name in ("F32", "F16"):
            values = raw.view(np.float32 if self.qtype.name == "F32" else np.float16)
        else:
            values = dequantize(raw, self.qtype)
        out = torch.from_numpy(np.asarray(values, dtype=np.float32))
        return out.reshape(*ids.shape, self.shape[1])
