"""Attention that gives a position the same bits however its tokens were grouped, on
torch's ops: what a stage runs where swarmd's own attention kernel (`attend.cpp`, through
`native.attend`) does not load (a CPU without AVX-512 BF16, no g++, `native_kernels =
false`). That kernel computes each query alone in one fixed order, so it needs none of
the shapes below; a stage takes one or the other for all its forwards.

A position's attention output must not depend on how the sequence reached the stage: a
prompt prefilled in one chunk or in several, a reply decoded one token at a time, a
failover's replay, a conversation's second turn that reuses the first turn's cached
positions, a stage that runs 1 or 4 torch threads. Then a reused prefix continues exactly
as a fresh node would, and a standby recomputes exactly what the lost stage held.

torch's own kernels do not give that. SDPA's CPU flash kernel blocks the work by query
and key lengths (and for one query splits a row among threads); a float32 matmul rounds
a row differently for 1-3 rows than for more, and for key counts below 64 or around 256
differently than for others (measured, torch 2.13, MKL). What was measured to hold, for
head dims 16-256, up to 8,192 keys, 1, 2 and 4 threads: given the same key count, a row
of `bmm(q, k^T)`, of `softmax` and of `bmm(w, v)` has the same bits for any row count
from 4 up. So every query is computed with the same shapes whatever else runs with it:

- it reads keys [first, first + width): `first` is its lowest visible position rounded
  down to a block of 64, `width` its span rounded up to a whole block (`span`); the keys
  outside its window in there are masked to -inf before the softmax, so their weights
  are exactly 0 (and the cache's unwritten positions are zeros, never NaN: see kv.py).
  A decode step attends the rows of one KV page that read the same span as one matmul
  (`scripted.py`): a row of it has the bits of the row alone (measured, as below);
- its heads sharing one KV head are padded to at least 4 rows;
- a chunk computes the queries that share (first, width) together, as rows of one
  matmul per KV head: consecutive positions share one every 64 tokens or so.

Measured cost (2 threads, 9 heads over 3 KV heads of 64): a decode row's attention in
one layer 26.5 against 21.9 us at 150 positions (the padded row, the keys to the block's
end, one fill); a prompt's attention 1.2-1.5x SDPA's fused kernel (`bench/exact_chunks.py`).

Plain functions of tensors: `scripted.py` compiles `attend_rows` into its TorchScript loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 64  # keys are read in whole blocks of this many positions
MIN_ROWS = 4  # from this many rows up a matmul row rounds the same whatever the count


def span(lo: int, hi: int) -> tuple[int, int]:
    """(first, width) of the keys a query that sees positions [lo, hi) reads."""
    first = lo // BLOCK * BLOCK
    return first, -(-(hi - first) // BLOCK) * BLOCK


def attend_rows(
    scaled: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """One query's attention: scaled q [kv, R, D] (R >= MIN_ROWS), keys transposed
    [kv, D, width] and values [kv, width, D] from the query's `span`, its visible keys
    [lo, hi) counted from that span's first; returns [kv, R, D]."""
    scores = torch.bmm(scaled, keys_t)  # [kv, R, width]
    width = scores.shape[2]
    if lo > 0:
        scores.narrow(2, 0, lo).fill_(float("-inf"))
    if hi < width:
        scores.narrow(2, hi, width - hi).fill_(float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), values)


def scaled_heads(q: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """q [heads, D] -> scaled [kv, R, D]: each KV head's query heads, padded to R rows."""
    heads, head_dim = q.shape
    group = heads // kv_heads
    scaled = q.reshape(kv_heads, group, head_dim) * scale
    if group < MIN_ROWS:
        scaled = F.pad(scaled, (0, 0, 0, MIN_ROWS - group))
    return scaled


def one_query(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lo: int,
    hi: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one position: q [heads, D] over the cached keys and values
    [kv, capacity, D] it sees at positions [lo, hi); returns [heads, D]. (Grouped-query:
    query head h reads KV head h // (heads / kv), as SDPA's `enable_gqa`.)"""
    heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    first, width = span(lo, hi)
    scaled = scaled_heads(q, kv_heads, scale)
    out = attend_rows(
        scaled,
        keys.narrow(1, first, width).transpose(1, 2),
        values.narrow(1, first, width),
        lo - first,
        hi - first,
    )
    return out.narrow(1, 0, heads // kv_heads).reshape(heads, head_dim)


@dataclass(frozen=True)
class QueryGroup:
    """Consecutive queries of a chunk that read the same keys: rows [start, end) of the
    chunk, keys [first, first + width), and -inf where each query (times its heads) does
    not see a key, for the first and the last block of the span."""

    start: int
    end: int
    first: int
    width: int
    hidden: list[tuple[int, torch.Tensor]]  # (column, [rows, BLOCK] mask)


def plan_chunk(windows: list[tuple[int, int]], group: int) -> list[QueryGroup]:
    """The groups of a chunk whose query t sees positions `windows[t]` = [lo, hi), with
    `group` query heads per KV head. Built once per chunk, used by each layer."""
    plan = []
    t = 0
    while t < len(windows):
        first, width = span(*windows[t])
        end = t + 1
        while end < len(windows) and span(*windows[end]) == (first, width):
            end += 1
        bounds = torch.tensor(windows[t:end], dtype=torch.long).repeat_interleave(group, 0)
        bounds -= first
        hidden = []
        for column in sorted({0, width - BLOCK}):
            columns = torch.arange(column, column + BLOCK)
            mask = (columns < bounds[:, :1]) | (columns >= bounds[:, 1:])  # [rows, BLOCK]
            if bool(mask.any()):
                hidden.append((column, mask))
        plan.append(QueryGroup(t, end, first, width, hidden))
        t = end
    return plan


def chunk_queries(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: list[QueryGroup],
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk's positions: q [T, heads, D], the cache's keys and values
    [kv, capacity, D], `plan` from `plan_chunk`; returns [T, heads, D], each row the bits
    `one_query` gives that position."""
    count, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    scaled = (q.reshape(count, kv_heads, group, head_dim) * scale).transpose(0, 1)
    out = torch.empty(kv_heads, count, group, head_dim, dtype=q.dtype)
    for g in plan:
        rows = (g.end - g.start) * group
        block = scaled[:, g.start : g.end].reshape(kv_heads, rows, head_dim)
        if rows < MIN_ROWS:
            block = F.pad(block, (0, 0, 0, MIN_ROWS - rows))
        scores = torch.bmm(block, keys.narrow(1, g.first, g.width).transpose(1, 2))
        for column, mask in g.hidden:
            scores.narrow(1, 0, rows).narrow(2, column, BLOCK).masked_fill_(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        got = torch.bmm(weights, values.narrow(1, g.first, g.width))  # [kv, rows, D]
        out[:, g.start : g.end] = got.narrow(1, 0, rows).view(kv_heads, -1, group, head_dim)
    return out.transpose(0, 1).reshape(count, heads, head_dim)
