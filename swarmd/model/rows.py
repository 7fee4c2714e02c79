"""`Row`: one sequence's chunk in a stage forward, the unit both backends batch over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Row:
    """[1, T] token ids (first stage) or [1, T, H] hidden states, with that sequence's cache."""

    inputs: torch.Tensor
    cache: Any
