"""KVCache: growing and forking keep what was written and leave zeros after it (attention
reads whole blocks past the written positions, so leftovers there would leak into a
softmax as NaN or noise)."""

from __future__ import annotations

import gc
import sys

import torch

from swarmd.engine.attention import BLOCK
from swarmd.engine.kv import KVCache, KVPool


def _written(cache: KVCache, start: int, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(3, count, 8, generator=generator)
    v = torch.randn(3, count, 8, generator=generator)
    cache.reserve(start + count)
    for layer in range(2):
        cache.write_and_read(layer, k, v, start)
    cache.length = start + count
    return torch.stack([k, v])


def _poison_allocator() -> None:
    # Freed NaN buffers of the sizes a cache takes make `torch.empty` likely to hand
    # NaN memory back: a cache that forgot to zero its tail would show it.
    for positions in (64, 128, 320, 384, 640, 1024):
        torch.full((2, 2, 1, 3, positions, 8), float("nan"))


def test_a_grown_cache_keeps_its_positions_and_is_zeros_after_them() -> None:
    cache = KVCache(2, 3, 8, torch.float32, max_length=2000)
    first = _written(cache, 0, 70, seed=1)
    old_capacity = cache.capacity
    _poison_allocator()
    second = _written(cache, 70, old_capacity, seed=2)  # past the first capacity
    assert cache.capacity > old_capacity and cache.capacity % BLOCK == 0
    buffer = cache.buffer
    for layer in range(2):
        assert torch.equal(buffer[layer, :, 0, :, :70], first)
        assert torch.equal(buffer[layer, :, 0, :, 70 : 70 + old_capacity], second)
        assert not buffer[layer, :, 0, :, cache.length :].any()


def test_a_fork_copies_the_prefix_only_and_is_zeros_after_it() -> None:
    cache = KVCache(2, 3, 8, torch.float32, max_length=2000)
    written = _written(cache, 0, 100, seed=3)
    _poison_allocator()
    fork = cache.fork(40, max_length=500)
    assert fork.length == 40 and fork.capacity % BLOCK == 0
    for layer in range(2):
        assert torch.equal(fork.buffer[layer, :, 0, :, :40], written[:, :, :40])
        assert not fork.buffer[layer, :, 0, :, 40:].any()
    # the fork is its own memory: writing it leaves the original as it was
    _written(fork, 40, 10, seed=4)
    assert torch.equal(cache.buffer[0, :, 0, :, :100], written)


def test_sessions_share_a_page_and_a_freed_slot_goes_back_to_the_os() -> None:
    """Caches of one class share a page; a dropped cache's slot reads as zeros at once
    (its memory returned to the OS, on Linux) while the page's other slots keep what
    they hold, and the next cache takes the lowest free slot."""
    pool = KVPool(2, 3, 64, torch.float32)
    caches = [KVCache(2, 3, 64, torch.float32, 2000, pool) for _ in range(3)]
    with torch.inference_mode():
        for i, cache in enumerate(caches):
            cache.reserve(600)
            cache.buffer.fill_(float(i + 1))
    page = caches[0].page
    assert page is not None and all(c.page is page for c in caches)
    assert [c.slot for c in caches] == [0, 1, 2] and pool.pages() == 1
    del caches[1]
    gc.collect()
    middle = page.tensor[:, :, 1]
    if sys.platform.startswith("linux"):
        assert not middle.any()  # given back: zeros without anyone writing them
    assert bool((page.tensor[:, :, 0] == 1).all()) and bool((page.tensor[:, :, 2] == 3).all())
    again = KVCache(2, 3, 64, torch.float32, 2000, pool)
    again.reserve(600)
    assert again.page is page and again.slot == 1 and not again.buffer.any()
    del caches, cache, again
    gc.collect()
    assert pool.pages() == 0  # every slot free: the page is gone
