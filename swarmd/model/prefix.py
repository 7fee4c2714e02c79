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


def continued(kept: Sequence[int], kept_prompt_length: int, prompt: Sequence[int]) -> int:
    """How many leading positions of a kept conversation (`kept`: the ids its cache holds,
    its prompt then its reply) a new `prompt` may reuse; 0 when it is no continuation.

    A continuation shares the conversation's whole prompt and then some of its reply: the
    next turn, which may take the cache over. Another request with the same system
    prompt, or the same prompt again, is not one: it may only copy the shared start
    (`StageRuntime._adopt`), since the conversation's own next turn may still come. The
    prompt's last token is always run for its logits, so at most all but it are reused.
    """
    shared = shared_start(kept, prompt)
    if shared <= kept_prompt_length:
        return 0
    reuse = min(shared, len(prompt) - 1)
    return reuse if reuse >= MIN_PREFIX_TOKENS else 0
