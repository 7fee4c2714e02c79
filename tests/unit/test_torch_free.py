"""The coordinator's modules import without torch (issue 16: a `--no-model` node).

torch alone is ~224 MB of resident memory; a node that holds no layers must stay under
300 MB, so none of these may import it, directly or through what they import. Each check
runs in a fresh interpreter whose import system refuses torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from swarmd.pipeline import wire

TORCH_FREE = (
    "swarmd.dtypes",
    "swarmd.model.sampling",
    "swarmd.model.grammar",
    "swarmd.model.memory",
    "swarmd.model.common",
    "swarmd.model.text",
    "swarmd.pipeline.wire",
    "swarmd.pipeline.links",
    "swarmd.pipeline.ring",
    "swarmd.pipeline.route",
    "swarmd.pipeline.variants",
    "swarmd.dht.swarm",
    "swarmd.transfer.take",
    "swarmd.model.jobs",
    "swarmd.pipeline.chain",
    "swarmd.pipeline.generation",
    "swarmd.pipeline.stage_service",
    "swarmd.pipeline.distributed",
    "swarmd.pipeline.coordinator",
    "swarmd.api.app",
    "swarmd.node",  # a --no-model node: swarmd.held (the torch side) only with a model
    "swarmd.cli",
)

# A meta-path finder that refuses torch, then the imports; prints what it refused, if any.
_PROBE = """
import sys

class NoTorch:
    refused = []

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            NoTorch.refused.append(name)
            raise ImportError("torch is blocked in this check")
        return None

sys.meta_path.insert(0, NoTorch())
import importlib
for module in sys.argv[1:]:
    importlib.import_module(module)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
assert not NoTorch.refused, NoTorch.refused
print("ok")
"""


def _probe(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_coordinator_modules_import_without_torch() -> None:
    done = _probe(*TORCH_FREE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_probe_sees_a_module_that_imports_torch() -> None:
    # The fence must be able to fail: a torch-side module is refused.
    done = _probe("swarmd.model.sampler")
    assert done.returncode != 0
    assert "torch is blocked" in done.stderr


@pytest.mark.parametrize(
    "values",
    [[], [0], [0, 1, 49151, 2**31 - 1, 5], [49152, 151935, 262143], list(range(0, 2**20, 4099))],
)
def test_ints_bytes_equal_the_torch_path(values: list[int]) -> None:
    # What the frames held before the coordinator went torch-free (int32, little-endian).
    assert wire.ints_to_bytes(values) == torch.tensor(values, dtype=torch.int32).numpy().tobytes()
    assert wire.ints_to_bytes(tuple(values)) == wire.ints_to_bytes(values)


def test_an_ids_step_frame_from_a_list_equals_one_from_a_tensor() -> None:
    ids = [0, 7, 49151, 2**31 - 1]
    from_list = wire.step_frame(3, True, ids, [1.5], 9, alone=True)
    from_tensor = wire.step_frame(3, True, torch.tensor([ids]), [1.5], 9, alone=True)
    assert from_list == from_tensor
    assert np.frombuffer(from_list["ids"], "<i4").tolist() == ids
