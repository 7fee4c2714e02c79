"""safetensors written and read one tensor at a time; a hostile header is a typed error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarmd.errors import ModelLoadError
from swarmd.model.tensorfile import TensorReader, TensorSpec, TensorWriter


def test_written_tensors_read_back_and_are_standard_safetensors(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).bfloat16(),
        "c": torch.randint(-100, 100, (4, 4), dtype=torch.int8),
        "d": torch.randint(0, 255, (2, 9), dtype=torch.uint8),
        "e": torch.empty(0, 3),
    }
    path = tmp_path / "t.safetensors"
    with TensorWriter(path, [TensorSpec.of(n, t) for n, t in tensors.items()], {"k": "v"}) as w:
        for name, tensor in tensors.items():
            w.write(name, tensor)
    with TensorReader(path) as reader:
        assert reader.names() == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(reader.get(name), tensor)
    assert all(torch.equal(t, tensors[n]) for n, t in load_file(str(path)).items())


def test_the_writer_refuses_what_was_not_declared(tmp_path: Path) -> None:
    spec = TensorSpec("a", "F32", (2,))
    with (
        pytest.raises(ModelLoadError, match="declared"),
        TensorWriter(tmp_path / "t.safetensors", [spec]) as writer,
    ):
        writer.write("a", torch.zeros(3))


HOSTILE = {
    "huge shape": ({"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4]}, "size"),
    "negative dim": ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    "three offsets": ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 5]}, "offsets"),
    "negative offset": ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "offsets"),
    "unknown dtype": ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}, "dtype"),
    "past the end": ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "ends inside"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_a_model_load_error(tmp_path: Path, case: str) -> None:
    entry, named = HOSTILE[case]
    raw = json.dumps({"a": entry}).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(ModelLoadError, match=named), TensorReader(path) as reader:
        reader.get("a")
