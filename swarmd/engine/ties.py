"""`settle_near_ties`: the leading logits of a bfloat16 head, taken again in float32.

The head's kernels read bfloat16 activations and write bfloat16 logits: 8 significant
bits, so around 25 the logits come in steps of 0.125 and the first two tokens of a reply
tie often. `argmax` then takes the lower token id, which says nothing about the model: on
the embedded model "What is the capital of France?" has "The" at 25.245 and "L" at 25.207
in float32, both 25.25 in bfloat16, and the greedy reply went to "L'Étoile, la
Marseillaise, ..." instead of "The capital of France is Paris.". So the logits within two
to four steps of each row's best are computed again, in float32, from the float32 normed hidden
state and the head's rows as held (int8 values times their scale, a GGUF block's d times
its values, or the float rows):
greedy picks what the held weights prefer, and a sampled draw sees their true gaps.

Each value is one row's elementwise products summed over the hidden size, so it has the
same bits in any batch and on any thread count (the reduction of one output is never
split at these sizes); which logits are taken again follows from the bfloat16 ones, which
have the same property.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmd.engine import native
from swarmd.engine.linear import Blocks, Dense, Int8, Int8Dot, Matrix

_SCAN = 1024  # logits per block when looking for the near-best ones
_COLUMNS = torch.arange(_SCAN)


def settle_near_ties(logits: torch.Tensor, normed: torch.Tensor, head: Matrix) -> None:
    """In place: logits [B, V] float32 (from `head` over `normed` [B, K] float32 cast to
    its dtype); those within 2 to 4 bfloat16 steps of their row's best become float32
    values."""
    rows = _rows_fp32(head)
    if rows is None:
        return
    best = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    # A bfloat16 step is 2^-7 to 2^-8 of the number: |best| / 64 is 2 to 4 steps.
    row, col = _at_least(logits, best - best.abs() * 2.0**-6)
    take, scale, bias = rows
    exact = (take(col).float() * normed[row]).sum(-1)
    if scale is not None:
        exact = exact * scale[col].float()
    if bias is not None:
        exact = exact + bias[col].float()
    logits[row, col] = exact


def _at_least(logits: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the logits [B, V] at or above their row's `floor` [B, 1]. A
    scan of the whole [B, V] for the few near the best costs a fifth of a millisecond at
    8 rows of 49,152; the maxima of blocks of `_SCAN` first, then only the blocks that
    reach the floor, cost a fraction of that."""
    vocab = logits.shape[1]
    whole = vocab // _SCAN * _SCAN
    maxima = logits[:, :whole].unflatten(1, (-1, _SCAN)).amax(-1)  # [B, blocks]
    hit_row, hit_block = torch.nonzero(maxima >= floor, as_tuple=True)
    columns = hit_block[:, None] * _SCAN + _COLUMNS  # [hits, _SCAN]
    near = logits[hit_row[:, None], columns] >= floor[hit_row]
    at, within = torch.nonzero(near, as_tuple=True)
    row, col = hit_row[at], columns[at, within]
    if whole < vocab:  # the last, partial block
        tail_row, tail_col = torch.nonzero(logits[:, whole:] >= floor, as_tuple=True)
        row, col = torch.cat([row, tail_row]), torch.cat([col, tail_col + whole])
    return row, col


Rows = Callable[[torch.Tensor], torch.Tensor]  # columns [C] -> their weight rows [C, K]


def _rows_fp32(head: Matrix) -> tuple[Rows, torch.Tensor | None, torch.Tensor | None] | None:
    """(rows of the held weights, scale or None, bias or None) of a head whose logits are
    rounded to a 16-bit float; None for a float32 head (already exact) or another format."""
    if isinstance(head, Int8Dot):
        blocked = head.packed
        return lambda col: native.int8_rows(blocked, col), head.scale, head.bias
    if isinstance(head, Int8):
        values = head.values
        return lambda col: values[col], head.scale, head.bias
    if isinstance(head, Blocks):  # a GGUF head kept in its Q4_0 / Q8_0 blocks
        return head.float_rows, None, head.bias
    if isinstance(head, Dense) and head.weight.dtype != torch.float32:
        weight = head.weight
        return lambda col: weight[col], None, head.bias
    return None
