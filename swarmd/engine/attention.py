"""`one_query`: a one-token step's attention, the same bits whatever the thread count.

Why not `scaled_dot_product_attention`: for a single query position torch's CPU flash
kernel shares one head's cached positions among the threads and merges their partial
sums, so the bits of a decode step depend on `--torch-threads` (measured, torch 2.13: one,
two and four threads disagree from 16 cached positions on). A swarm's nodes run different
thread counts, and a standby that takes over a reply must continue it as the failed stage
would have; so a decode step attends with plain ops whose work is split by rows only:
q.K^T and P.V as matmuls (each output element summed by one thread) and a softmax over
each row. Measured equal across 1, 2 and 4 threads up to 8,000 cached positions. Its
cost against SDPA's, 30 layers of the embedded model run as TorchScript: +0.2 ms a token
at 150 cached positions, +0.1 at 400, -1.0 at 1,000.

Prompt chunks keep SDPA: with several query positions its kernel splits the work by
heads and query blocks, never within a row (equal across thread counts, measured).

Plain functions of tensors: `scripted.py` compiles this one into its TorchScript loop.
"""

from __future__ import annotations

import torch


def one_query(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one position: q [1, heads, 1, D] over keys and values
    [1, kv_heads, L, D] (grouped-query: query head h reads kv head h // (heads / kv_heads),
    as SDPA's `enable_gqa`); returns [1, heads, 1, D]."""
    kv_heads = keys.shape[1]
    heads = q.shape[1]
    head_dim = q.shape[3]
    grouped = q.reshape(kv_heads, heads // kv_heads, head_dim)  # the heads of each kv head
    # Scaling q rather than the scores: [kv, group, D] elements instead of [kv, group, L].
    out = scaled_query(grouped * scale, keys[0].transpose(1, 2), values[0])
    return out.view(1, heads, 1, head_dim)


def scaled_query(scaled: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`one_query`'s arithmetic: scaled q [kv, group, D], keys transposed [kv, D, L],
    values [kv, L, D] -> [kv, group, D]. The scripted loop calls it with views it built
    for a whole step (the same strides, so the same bits as `one_query`)."""
    weights = torch.softmax(torch.bmm(scaled, keys_t), dim=-1)  # [kv, group, L]
    return torch.bmm(weights, values)
