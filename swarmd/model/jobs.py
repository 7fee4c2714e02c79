"""The torch worker's jobs: `OpenJob`, `StepJob`, `CloseJob`.

Apart from the worker so that the stage service and the coordinator name them without
importing torch (a node holding no layers never loads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OpenJob:
    session_id: str
    max_length: int  # tokens the session may hold
    sampling: SamplingParams | None  # only where the last stage samples
    history: tuple[int, ...] = ()  # reply tokens so far (a session rebuilt after failover)
    layers: LayerRange | None = None  # part of what this node holds; None = all
    prompt: tuple[int, ...] = ()  # the prompt ids (a whole-model session: prefix reuse)
    share: str | None = None  # an open session of the same prompt whose cache to copy
    resume: tuple[str, int] | None = None  # (key, n): a kept cache to take, cut to n
    copy: bool = False  # with `resume`: copy those n positions, the cache stays kept
    keep_as: str | None = None  # keep this session's cache under this key when it ends
    ring: int = 1  # stages on the session's route (1: this node runs every layer)


@dataclass(frozen=True)
class StepJob:
    session_id: str
    inputs: torch.Tensor  # [1, T] ids (first stage) or [1, T, H] hidden states
    want_token: bool


@dataclass(frozen=True)
class CloseJob:
    session_id: str


Job = OpenJob | StepJob | CloseJob
