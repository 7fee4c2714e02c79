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

    def __init__(self, path: Path, meta: Path, weights: str) -> None:
        architecture, entries = read_index(meta)
        check_tensor_types(entries)
        config: dict[str, Any] = json.loads((meta / "config.json").read_text())
        self.path = path
        self._entries = {e.name: e for e in entries}
        self._plans = {p.name: p for p in plan(entries, config, architecture, weights)}
        try:
            self._map: np.ndarray | None = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"Cannot map the GGUF file {path}: {exc}") from exc
        self.spans: list[tuple[int, int]] = []  # (offset, length) of every tensor read

    def __contains__(self, name: str) -> bool:
        return name in self._plans

    def plans(self) -> list[Plan]:
        return list(self._plans.values())

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
        return stored_matrix(plan_, data)

    def get(self, name: str) -> torch.Tensor:
        stored = self.matrix(name)
        if not isinstance(stored, torch.Tensor):
            raise ModelLoadError(f"GGUF tensor for '{name}' is a quantized matrix, not a vector")
        return stored

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._plans else None

    def close(self) -> None:
        # Dropping the map unmaps the file: its pages stop counting in this process.
        self._map = None

    def __enter__(self) -> GgufTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plan(self, name: str) -> Plan:
        found = self._plans.get(name)
        if found is None:
            raise ModelLoadError(f"Tensor '{name}' is missing from {self.path.name}")
        return found
