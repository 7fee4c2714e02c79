"""`KVCache`: one session's keys and values on one stage, in a slot of a shared page.

A session's keys and values live in one slot [layers, 2, 1, kv_heads, capacity, head_dim]
of a page [layers, 2, slots, kv_heads, capacity, head_dim] that sessions of the same
capacity share (`KVPool`). So a decode step reads the keys of the sessions of a page as
one tensor: one matmul per layer for those that read the same span, not one per session
(`scripted.py`). The capacity is a class of the positions held (`capacity_class`: steps
of 64, then of an eighth of a power of two past 512); it decides where a session's
keys sit, never which keys a query reads (`attention.span`), so it changes no bits.

A step writes its new positions in place; a cache that outgrows its class moves to a slot
of the next one (one copy each time). A slot goes back to its page when its cache is
dropped, its memory back to the OS (on Linux: the page is an anonymous mapping of its
own), and a page whose slots are all free is unmapped: memory is only taken by slots in
use.

Attention reads keys in whole blocks past the positions written: a slot is zeros there
when taken, never whatever the allocator or an earlier session left (a NaN times a weight
of 0 would be NaN).
"""

from __future__ import annotations

import heapq
import math
import mmap
import sys
import threading
import weakref

import torch

MIN_CLASS = 64  # positions: a class is a multiple of it (attention's block)
# A page holds as many slots as fit in this (at least 1, at most 16). Its memory is only
# taken as slots are used (an untouched allocation), so a large page costs nothing idle.
_PAGE_BYTES = 512 << 20
_MAX_SLOTS = 16
# Where an anonymous mapping's pages given back (MADV_DONTNEED) read as zeros after.
_GIVES_BACK = sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


def capacity_class(positions: int) -> int:
    """The capacity that holds `positions`: a multiple of 64, and past 512 of an eighth of
    the power of two at or above them (640, 768, ..., 1,024, 1,280, ...), so a slot is
    never a quarter larger than its positions need past its first 64. Up to 512 that is
    the span a query at the last position reads (`attention.span`): the rows of a page
    mostly read one span, one matmul."""
    top = 1 << max(0, positions - 1).bit_length()
    step = max(MIN_CLASS, top // 8)
    return max(MIN_CLASS, -(-positions // step) * step)


class _Page:
    """Slots of one capacity: `tensor` [layers, 2, slots, kv_heads, capacity, head_dim],
    over anonymous memory of its own (`region`) where the OS allows giving a freed slot's
    memory back (Linux); `clean`: the free slots known to be zeros."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        self.region: mmap.mmap | None = None
        if _GIVES_BACK:
            # Zeros until written, and a freed slot's pages go back to the OS at once
            # (`give_back`): a page held by one kept conversation keeps only that slot.
            self.region = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self.region, dtype=dtype, count=count).view(shape)
        else:
            self.tensor = torch.empty(shape, dtype=dtype)  # zeroed slot by slot when taken
        self.slots = int(shape[2])
        self.free = list(range(self.slots))  # a heap: the lowest slot first
        self.clean = set(self.free) if self.region is not None else set()
        self._chunk = nbytes // (shape[0] * shape[1] * self.slots)  # a slot's K or V, a layer

    def give_back(self, slot: int) -> bool:
        """Return a slot's memory to the OS (it reads as zeros after); False if it
        cannot be (no region of its own, or its chunks are not whole OS pages)."""
        if self.region is None or self._chunk % mmap.PAGESIZE:
            return False
        for part in range(int(self.tensor.shape[0]) * 2):  # every layer's K, then V
            offset = (part * self.slots + slot) * self._chunk
            self.region.madvise(mmap.MADV_DONTNEED, offset, self._chunk)
        return True


class KVPool:
    """The pages of one stage's caches, by capacity class; thread-safe (a cache may be
    dropped on any thread)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.dims = (num_layers, 2, kv_heads, head_dim)
        self.dtype = dtype
        self._pages: dict[int, list[_Page]] = {}
        self._lock = threading.Lock()

    @torch.inference_mode()  # a page may be made inside a forward or outside: always inside
    def take(self, capacity: int) -> tuple[_Page, int]:
        """A free slot of `capacity` (a class), zeros: (page, slot)."""
        with self._lock:
            pages = self._pages.setdefault(capacity, [])
            page = next((p for p in pages if p.free), None)
            if page is None:
                page = _Page(self._shape(capacity), self.dtype)
                pages.append(page)
            slot = heapq.heappop(page.free)
            clean = slot in page.clean
            page.clean.discard(slot)
        if not clean:
            page.tensor[:, :, slot].zero_()
        return page, slot

    def release(self, page: _Page, slot: int) -> None:
        clean = page.give_back(slot)  # before it is free: nobody can have taken it yet
        with self._lock:
            heapq.heappush(page.free, slot)
            if clean:
                page.clean.add(slot)
            pages = self._pages.get(int(page.tensor.shape[4]), [])
            if len(page.free) == page.slots and page in pages:
                pages.remove(page)  # all free: the whole page goes back

    def pages(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pages.values())

    def _shape(self, capacity: int) -> tuple[int, ...]:
        layers, two, kv_heads, head_dim = self.dims
        slot_bytes = layers * two * kv_heads * capacity * head_dim * self.dtype.itemsize
        slots = max(1, min(_MAX_SLOTS, _PAGE_BYTES // slot_bytes))
        return (layers, two, slots, kv_heads, capacity, head_dim)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_length: int,
        pool: KVPool | None = None,
    ) -> None:
        self.max_length = max_length
        self.length = 0  # positions written so far
        self.pool = pool if pool is not None else KVPool(num_layers, kv_heads, head_dim, dtype)
        self.page: _Page | None = None
        self.slot = 0
        self._release: weakref.finalize | None = None
        self._buffer = torch.zeros(num_layers, 2, 1, kv_heads, 0, head_dim, dtype=dtype)

    @property
    def buffer(self) -> torch.Tensor:
        """[layers, 2, 1, kv_heads, capacity, head_dim]: the slot (a view of its page).
        A view of it holds what the cache holds only while the cache lives: a dropped
        cache's slot is zeros, then another session's."""
        return self._buffer

    @property
    def capacity(self) -> int:
        return int(self._buffer.shape[4])

    def reserve(self, total: int) -> None:
        """Room for `total` positions (the next step's end): the class that holds them."""
        if total > self.capacity:
            self._move(capacity_class(total), self._buffer, self.length)

    def fork(self, length: int, max_length: int) -> KVCache:
        """A new cache holding a copy of this one's first `length` positions (another
        reply to the same prompt: the prompt is prefilled once)."""
        if length > self.length:
            raise ValueError(f"cannot fork {length} positions of a cache holding {self.length}")
        layers, _, kv_heads, head_dim = self.pool.dims
        other = KVCache(layers, kv_heads, head_dim, self.pool.dtype, max_length, self.pool)
        other._move(capacity_class(max(length, 1)), self._buffer, length)
        other.length = length
        return other

    @torch.inference_mode()
    def _move(self, capacity: int, keep: torch.Tensor, length: int) -> None:
        """Into a zeroed slot of `capacity`, the first `length` positions of `keep` copied."""
        page, slot = self.pool.take(capacity)
        buffer = page.tensor[:, :, slot : slot + 1]
        if length:
            buffer[..., :length, :].copy_(keep[..., :length, :])
        if self._release is not None:
            self._release()  # the old slot back to its page
        self.page, self.slot, self._buffer = page, slot, buffer
        self._release = weakref.finalize(self, self.pool.release, page, slot)

    @torch.inference_mode()
    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, D] at positions start.. (reserved first); return the
        whole key and value buffers [kv_heads, capacity, D], what attention reads its
        blocks from."""
        end = start + k.shape[1]
        keys, values = self._buffer[layer, :, 0]
        keys[:, start:end] = k
        values[:, start:end] = v
        return keys, values
