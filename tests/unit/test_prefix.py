"""The shared-start rule prefix reuse applies on one node and on a route."""

from __future__ import annotations

import random

from swarmd.model.prefix import MIN_PREFIX_TOKENS, continued, shared_start


def naive(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_start_equals_an_id_by_id_count_for_lists_and_tuples() -> None:
    rng = random.Random(3)
    for _ in range(500):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 60))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(5))]
        assert shared_start(a, b) == naive(a, b)
        assert shared_start(tuple(a), b) == shared_start(b, tuple(a)) == naive(a, b)
    assert shared_start([], [1]) == 0 and shared_start([1, 2], [1, 2]) == 2


def test_a_continuation_repeats_the_whole_prompt_and_keeps_the_last_token_to_run() -> None:
    prompt = list(range(20))
    kept = [*prompt, 100, 101, 102]
    assert continued(kept, len(prompt), [*prompt, 100, 101, 7]) == len(prompt) + 2
    assert continued(kept, len(prompt), [*prompt, 100, 101, 102]) == len(prompt) + 2
    assert continued(kept, len(prompt), [*prompt, 9]) == 0  # the prompt again: no continuation
    short = list(range(MIN_PREFIX_TOKENS - 3))
    assert continued([*short, 1, 2], len(short), [*short, 1, 5]) == 0  # too short to keep
