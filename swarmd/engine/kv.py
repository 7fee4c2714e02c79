"""`KVCache`: one session's keys and values on one stage, grown in place.

One float32 buffer [layers, 2, B, kv_heads, capacity, head_dim] per session: a step
writes its new positions with one copy per tensor and attention reads a view of the
cached positions, so no step concatenates the whole past. The first step reserves 256
positions past its need; beyond that the capacity doubles (never past the session's
`max_length`), copying once per doubling. A single allocation
per session is returned to the OS whole when the session ends (many small per-layer
buffers fragment the heap).

Attention reads keys in whole blocks (`attention.span`), past the positions written: so
the capacity is a whole number of blocks, and a new buffer is zeros there, never whatever
the allocator left (a NaN times a weight of 0 would be NaN).
"""

from __future__ import annotations

import torch

from swarmd.engine.attention import BLOCK

_HEADROOM = 256  # positions reserved past the first need: most replies then never regrow


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_length: int,
        batch: int = 1,
    ) -> None:
        self.max_length = max_length
        self.length = 0  # positions written so far
        self._dims = (num_layers, 2, batch, kv_heads)
        self._head_dim = head_dim
        self._dtype = dtype
        self._buffer = self._empty(0)

    def _empty(
        self, capacity: int, keep: torch.Tensor | None = None, length: int = 0
    ) -> torch.Tensor:
        """A buffer of `capacity` positions rounded up to whole blocks: the first `length`
        copied from `keep`, zeros after them."""
        blocks = -(-capacity // BLOCK) * BLOCK
        out = torch.empty(*self._dims, blocks, self._head_dim, dtype=self._dtype)
        if keep is not None and length:
            out[..., :length, :].copy_(keep[..., :length, :])
        out[..., length:, :].zero_()
        return out

    @property
    def buffer(self) -> torch.Tensor:
        """[layers, 2, B, kv_heads, capacity, head_dim]: what a scripted step writes into."""
        return self._buffer

    @property
    def capacity(self) -> int:
        return int(self._buffer.shape[4])

    def reserve(self, total: int) -> None:
        """Room for `total` positions (the next step's end)."""
        if total <= self.capacity:
            return
        size = max(total + _HEADROOM, self.capacity * 2)
        size = min(size, max(self.max_length, total))
        self._buffer = self._empty(size, self._buffer, self.length)

    def fork(self, length: int, max_length: int) -> KVCache:
        """A new cache holding a copy of this one's first `length` positions (another
        reply to the same prompt: the prompt is prefilled once)."""
        if length > self.length:
            raise ValueError(f"cannot fork {length} positions of a cache holding {self.length}")
        other = KVCache.__new__(KVCache)
        other.max_length = max_length
        other.length = length
        other._dims, other._head_dim, other._dtype = self._dims, self._head_dim, self._dtype
        capacity = min(max(length + _HEADROOM, 1), max(max_length, length))
        other._buffer = self._empty(capacity, self._buffer, length)
        return other

    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, D] of row 0 at positions start.. (reserved first);
        return that row's whole key and value buffers [kv_heads, capacity, D], what
        attention reads its blocks from."""
        end = start + k.shape[1]
        keys, values = self._buffer[layer, :, 0]
        keys[:, start:end] = k
        values[:, start:end] = v
        return keys, values
