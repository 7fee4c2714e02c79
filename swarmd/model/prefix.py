"""When a prompt continues a finished conversation (prefix reuse), in one place.

Torch-free: a stage's runtime and a route's coordinator (which may hold no layers)
apply the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_PREFIX_TOKENS = 16  # a shorter shared start is not worth keeping a cache for


def shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share. Every open compares its prompt with each
    kept conversation and open session (thousands of ids each) on the torch worker, so
    this compares slices (C speed) and bisects, instead of looping over ids in Python."""
    left, right = list(a), list(b)
    n = min(len(left), len(right))
    if left[:n] == right[:n]:
        return n
    lo, hi = 0, n - 1  # left[:lo] == right[:lo], and they differ within [:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if left[:mid] == right[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def reuse(kept: Sequence[int], kept_prompt_length: int, prompt: Sequence[int]) -> tuple[int, int]:
    """What a new `prompt` may reuse of a kept conversation (`kept`: the ids its cache
    holds, its prompt then its reply): (positions a continuation takes over, positions a
    shared start may copy), 0 where neither. Both are the shared start, at most all but
    the prompt's last token (always run for its logits), and at least MIN_PREFIX_TOKENS.

    A continuation shares the conversation's whole prompt and then some of its reply: the
    next turn, which may take the cache over. Another request with the same system
    prompt, or the same prompt again, is not one: it may only copy the shared start,
    since the conversation's own next turn may still come.
    """
    shared = shared_start(kept, prompt)
    copy = min(shared, len(prompt) - 1)
    if copy < MIN_PREFIX_TOKENS:
        return 0, 0
    return (copy if shared > kept_prompt_length else 0), copy


def continued(kept: Sequence[int], kept_prompt_length: int, prompt: Sequence[int]) -> int:
    """What a continuation of `kept` takes over (`reuse`); 0 when `prompt` is none."""
    return reuse(kept, kept_prompt_length, prompt)[0]
