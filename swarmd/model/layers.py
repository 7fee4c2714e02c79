"""`LayerRange`: a half-open range of decoder layers, [start, end)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from swarmd.errors import ConfigError, ModelLoadError


@dataclass(frozen=True, order=True)
class LayerRange:
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ConfigError(f"Layer range {self.start}:{self.end} is empty or negative")

    @classmethod
    def parse(cls, text: str, num_layers: int) -> LayerRange:
        """Parse 'START:END' (either side may be empty) against a model of num_layers."""
        head, sep, tail = text.partition(":")
        if not sep:
            raise ConfigError(f"Layer range '{text}' must look like START:END, e.g. 0:15")
        try:
            start = int(head) if head.strip() else 0
            end = int(tail) if tail.strip() else num_layers
        except ValueError as exc:
            raise ConfigError(f"Layer range '{text}' must be two integers START:END") from exc
        if end > num_layers:
            raise ConfigError(f"Layer range '{text}' ends past the model's {num_layers} layers")
        return cls(start, end)

    @property
    def size(self) -> int:
        return self.end - self.start

    def offsets_in(self, held: LayerRange) -> tuple[int, int]:
        """This range as [lo, hi) offsets into `held`; ModelLoadError if not inside it."""
        if not (held.start <= self.start and self.end <= held.end):
            raise ModelLoadError(f"Layers {self} are not inside this stage's {held}")
        return self.start - held.start, self.end - held.start

    def is_first(self) -> bool:
        return self.start == 0

    def is_last(self, num_layers: int) -> bool:
        return self.end == num_layers

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def tiling_problem(ranges: Iterable[tuple[int, int]], num_layers: int) -> str | None:
    """What keeps `ranges` from covering [0, num_layers) in order, once each; None if
    nothing does (the rule for the shards of a manifest)."""
    at = 0
    for start, end in ranges:
        if start != at or end <= start:
            return f"{start}:{end} where layer {at} comes next"
        at = end
    if at != num_layers:
        return f"the ranges end at layer {at}, the model has {num_layers}"
    return None


RECOMPUTED = -1  # `tensor_layer` of a buffer rebuilt from the config (rotary inv_freq)
_DECODER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def tensor_layer(name: str, num_layers: int) -> int | None:
    """The layer a checkpoint tensor travels with: its decoder layer, layer 0 for the
    embeddings, the last layer for the final norm and the LM head; RECOMPUTED for a
    buffer old checkpoints carry; None for a name this does not know."""
    match = _DECODER_TENSOR.match(name)
    if match:
        return int(match.group(1))
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith(("model.norm.", "lm_head.")):
        return num_layers - 1
    if name.endswith("rotary_emb.inv_freq"):
        return RECOMPUTED
    return None
