"""`settle_near_ties`: the leading logits of a bfloat16 head, taken again in float32.

The head's kernels read bfloat16 activations and write bfloat16 logits: 8 significant
bits, so around 25 the logits come in steps of 0.125 and the first two tokens of a reply
tie often. `argmax` then takes the lower token id, which says nothing about the model: on
the embedded model "What is the capital of France?" has "The" at 25.245 and "L" at 25.207
in float32, both 25.25 in bfloat16, and the greedy reply went to "L'Étoile, la
Marseillaise, ..." instead of "The capital of France is Paris.". So the logits within two
steps of each row's best are computed again, in float32, from the float32 normed hidden
state and the head's rows as held (int8 values times their scale, or the float rows):
greedy picks what the held weights prefer, and a sampled draw sees their true gaps.

Each value is one row's elementwise products summed over the hidden size, so it has the
same bits in any batch and on any thread count (the reduction of one output is never
split at these sizes); which logits are taken again follows from the bfloat16 ones, which
have the same property.
"""

from __future__ import annotations

import torch

from swarmd.engine.linear import Dense, Int8, Matrix

STEPS = 2  # how many bfloat16 steps below a row's best a logit is still taken again


def settle_near_ties(logits: torch.Tensor, normed: torch.Tensor, head: Matrix) -> None:
    """In place: logits [B, V] float32 (from `head` over `normed` [B, K] float32 cast to
    its dtype); those within `STEPS` of their row's best become float32 values."""
    rows = _rows_fp32(head)
    if rows is None:
        return
    best = logits.max(dim=-1, keepdim=True).values  # [B, 1]
    # One step of a bfloat16 number around the best: 2^(exponent - 7).
    step = torch.ldexp(torch.ones_like(best), torch.frexp(best).exponent - 8)
    row, col = torch.nonzero(logits >= best - STEPS * step, as_tuple=True)
    weights, scale, bias = rows
    exact = (weights[col].float() * normed[row]).sum(-1)
    if scale is not None:
        exact = exact * scale[col].float()
    if bias is not None:
        exact = exact + bias[col].float()
    logits[row, col] = exact


def _rows_fp32(
    head: Matrix,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(values, scale or None, bias or None) of a head whose logits are rounded to a
    16-bit float; None for a float32 head (already exact) or another format."""
    if isinstance(head, Int8):
        return head.values, head.scale, head.bias
    if isinstance(head, Dense) and head.weight.dtype != torch.float32:
        return head.weight, None, head.bias
    return None
