"""Sampling filters and the Sampler, on small hand-made logits with exact expectations."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from swarmd.model.sampler import (
    Sampler,
    apply_logit_bias,
    apply_penalties,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)
from swarmd.model.sampling import IMPOSSIBLE, SamplingParams, draw_seed

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (which must sum to 1)."""
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def kept(logits: torch.Tensor) -> set[int]:
    """Token ids a filter left finite."""
    return {int(i) for i in torch.nonzero(torch.isfinite(logits)).flatten()}


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> list[int]:
    return [sampler.sample(logits) for _ in range(n)]


def frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = Counter(tokens)
    return [counts[t] / len(tokens) for t in range(vocab)]


# Probabilities deliberately out of order, so the filters' sort + scatter back is exercised:
# by rank: token 2 (0.50), token 0 (0.30), token 3 (0.15), token 1 (0.05).
SHUFFLED = logits_of([0.30, 0.05, 0.50, 0.15])


# --- top_k -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, {2}), (2, {2, 0}), (3, {2, 0, 3})],
)
def test_top_k_keeps_the_k_largest(k: int, expected: set[int]) -> None:
    out = top_k_filter(SHUFFLED, k)
    assert kept(out) == expected
    # Kept tokens keep their logit unchanged.
    for t in expected:
        assert out[t] == SHUFFLED[t]


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5])
    assert kept(top_k_filter(logits, 2)) == {1, 2, 3}
    assert kept(top_k_filter(logits, 3)) == {1, 2, 3}
    assert kept(top_k_filter(logits, 4)) == {0, 1, 2, 3}


@pytest.mark.parametrize("k", [0, -1, 4, 5, 100])
def test_top_k_off_or_not_smaller_than_vocab_is_identity(k: int) -> None:
    assert torch.equal(top_k_filter(SHUFFLED, k), SHUFFLED)


# --- top_p -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (0.01, {2}),  # the top token always stays, even when it alone exceeds p
        (0.45, {2}),
        (0.55, {2, 0}),  # 0.50 < 0.55, so the second token is needed
        (0.79, {2, 0}),
        (0.81, {2, 0, 3}),
        (0.90, {2, 0, 3}),
        (0.96, {2, 0, 3, 1}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(p: float, expected: set[int]) -> None:
    out = top_p_filter(SHUFFLED, p)
    assert kept(out) == expected
    for t in expected:
        assert out[t] == SHUFFLED[t]


def test_top_p_of_one_is_identity() -> None:
    assert torch.equal(top_p_filter(SHUFFLED, 1.0), SHUFFLED)


def test_top_p_ignores_tokens_already_masked() -> None:
    logits = torch.tensor([2.0, NEG_INF, 1.0, NEG_INF])
    assert kept(top_p_filter(logits, 0.999)) == {0, 2}


# --- min_p -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.05, {0, 1, 2, 3}),  # threshold 0.025: all stay
        (0.20, {2, 0, 3}),  # threshold 0.10: 0.05 goes
        (0.50, {2, 0}),  # threshold 0.25: 0.15 goes
        (0.70, {2}),  # threshold 0.35: 0.30 goes
        (1.00, {2}),  # only the top token reaches its own probability
    ],
)
def test_min_p_is_relative_to_the_top_probability(min_p: float, expected: set[int]) -> None:
    out = min_p_filter(SHUFFLED, min_p)
    assert kept(out) == expected
    for t in expected:
        assert out[t] == SHUFFLED[t]


def test_min_p_scales_with_the_top_token_not_absolute() -> None:
    # A flat-ish distribution: the top is 0.3, so min_p 0.5 keeps tokens >= 0.15,
    # although no token is anywhere near an absolute probability of 0.5.
    logits = logits_of([0.3, 0.25, 0.2, 0.15 + 0.001, 0.1 - 0.001])
    assert kept(min_p_filter(logits, 0.5)) == {0, 1, 2, 3}


def test_min_p_of_zero_is_identity() -> None:
    assert torch.equal(min_p_filter(SHUFFLED, 0.0), SHUFFLED)


# --- penalties and logit bias -----------------------------------------------------------


def test_penalties_follow_the_openai_formula() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    counts = torch.tensor([0.0, 2.0, 1.0, 0.0])
    out = apply_penalties(logits, counts, presence=0.5, frequency=0.25)
    # logit -= frequency * count + presence * (count > 0)
    assert out.tolist() == [1.0, 1.0, 2.25, 4.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # input untouched


def test_negative_penalties_raise_seen_tokens() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0])
    counts = torch.tensor([3.0, 0.0, 1.0])
    out = apply_penalties(logits, counts, presence=-1.0, frequency=-0.5)
    assert out.tolist() == [2.5, 0.0, 1.5]


def test_zero_penalties_are_identity() -> None:
    counts = torch.tensor([5.0, 1.0, 0.0, 2.0])
    assert torch.equal(apply_penalties(SHUFFLED, counts, 0.0, 0.0), SHUFFLED)


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = apply_logit_bias(logits, {1: 5.0, 3: -100.0})
    assert out.tolist() == [1.0, 7.0, 3.0, -96.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # input untouched


def test_empty_logit_bias_is_identity() -> None:
    assert torch.equal(apply_logit_bias(SHUFFLED, {}), SHUFFLED)


# --- Sampler: greedy ---------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0), vocab_size=4)
    assert SamplingParams(temperature=0.0).greedy
    assert draws(sampler, SHUFFLED, 5) == [2, 2, 2, 2, 2]
    assert sampler.sample(torch.tensor([0.1, -3.0, 7.5, 7.6])) == 3


def test_greedy_ignores_the_truncation_filters() -> None:
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)
    sampler = Sampler(params, vocab_size=4)
    assert sampler.sample(torch.tensor([0.0, 1.0, 5.0, 2.0])) == 2


def test_greedy_applies_logit_bias() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={1: 10.0}), vocab_size=4)
    assert sampler.sample(SHUFFLED) == 1


def test_sample_counts_the_token_it_returns() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0), vocab_size=4)
    draws(sampler, SHUFFLED, 3)
    sampler.observe(1)
    assert sampler.counts.tolist() == [0.0, 1.0, 3.0, 0.0]


# --- Sampler: seeds --------------------------------------------------------------------


FLAT = torch.zeros(100)


def test_same_seed_gives_the_same_sequence() -> None:
    first = draws(Sampler(SamplingParams(seed=1234), 100), FLAT, 50)
    second = draws(Sampler(SamplingParams(seed=1234), 100), FLAT, 50)
    assert first == second
    assert len(set(first)) > 20  # it really is random over a flat distribution


def test_different_seeds_give_different_sequences() -> None:
    first = draws(Sampler(SamplingParams(seed=1), 100), FLAT, 50)
    second = draws(Sampler(SamplingParams(seed=2), 100), FLAT, 50)
    assert first != second


def test_no_seed_gives_different_sequences() -> None:
    first = draws(Sampler(SamplingParams(), 100), FLAT, 50)
    second = draws(Sampler(SamplingParams(), 100), FLAT, 50)
    assert first != second


def test_a_draw_depends_on_seed_and_position_only() -> None:
    """A failover's new last stage is told the reply so far and then draws what the
    lost one would have; a batch neighbour's draws change nothing."""
    whole = draws(Sampler(SamplingParams(seed=99), 100), FLAT, 40)
    rebuilt = Sampler(SamplingParams(seed=99), 100)
    for token in whole[:25]:
        rebuilt.observe(token)
    assert draws(rebuilt, FLAT, 15) == whole[25:]
    interleaved, other = Sampler(SamplingParams(seed=99), 100), Sampler(SamplingParams(), 100)
    got = []
    for _ in range(40):
        draws(other, FLAT, 1)
        got.append(interleaved.sample(FLAT))
    assert got == whole


def test_draw_seeds_differ_by_position_and_seed() -> None:
    seeds = {draw_seed(s, p) for s in (0, 1, -5, 2**64 - 1) for p in range(100)}
    assert len(seeds) == 400
    assert all(0 <= x < 2**64 for x in seeds)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_are_those_of_the_distribution_drawn_from(temperature: float) -> None:
    logits = torch.tensor([3.0, 1.0, 0.5, -2.0, 0.0])
    params = SamplingParams(temperature=temperature, top_k=3, seed=5, top_logprobs=4)
    drawn = Sampler(params, 5).draw(logits)
    assert drawn.logprobs is not None
    if temperature == 0.0:  # greedy: the distribution at temperature 1, unfiltered
        expected = torch.log_softmax(logits, dim=-1)
    else:
        expected = torch.log_softmax(top_k_filter((logits - 3.0) / temperature, 3), dim=-1)
    assert drawn.logprobs.logprob == pytest.approx(float(expected[drawn.token]))
    top = drawn.logprobs.top
    assert [i for i, _ in top][:3] == [0, 1, 2]
    assert all(lp <= 0.0 for _, lp in top) and len(top) == 4
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    if temperature > 0.0:  # the 4th is filtered out: impossible, and still a number
        assert top[3][1] == IMPOSSIBLE


def test_no_logprobs_unless_asked() -> None:
    assert Sampler(SamplingParams(temperature=0.0), 4).draw(BASE).logprobs is None
    zero = Sampler(SamplingParams(temperature=0.0, top_logprobs=0), 4).draw(BASE).logprobs
    assert zero is not None and zero.top == () and zero.logprob <= 0.0


class _OnlyOdd:
    """A constraint that allows odd token ids only, and records what it was told."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[0::2] = float("-inf")
        return out

    def accept(self, token: int) -> None:
        assert token % 2 == 1
        self.accepted.append(token)


def test_a_constraint_masks_every_draw_and_is_told_every_token() -> None:
    constraint = _OnlyOdd()
    sampler = Sampler(SamplingParams(seed=3), 100, constraint)
    sampler.observe(7)  # a replayed reply token reaches the grammar too
    tokens = draws(sampler, FLAT, 30)
    assert all(t % 2 == 1 for t in tokens)
    assert constraint.accepted == [7, *tokens]
    greedy = Sampler(SamplingParams(temperature=0.0), 4, _OnlyOdd())
    assert greedy.sample(BASE) == 1  # the best odd token, not the best token


# --- Sampler: distributions --------------------------------------------------------------


BASE = torch.tensor([2.0, 1.0, 0.0, -1.0])
N_DRAWS = 5000
# Binomial std at n=5000 is at most 0.0071; 0.025 is over 3.5 sigma, and the seed is fixed.
TOLERANCE = 0.025


def test_temperature_one_matches_softmax() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7), vocab_size=4)
    observed = frequencies(draws(sampler, BASE, N_DRAWS), 4)
    expected = torch.softmax(BASE, dim=-1).tolist()
    # softmax([2, 1, 0, -1]) = [0.644, 0.237, 0.087, 0.032]
    assert expected == pytest.approx([0.6439, 0.2369, 0.0871, 0.0321], abs=1e-3)
    assert observed == pytest.approx(expected, abs=TOLERANCE)


def test_low_temperature_sharpens() -> None:
    sampler = Sampler(SamplingParams(temperature=0.5, seed=7), vocab_size=4)
    observed = frequencies(draws(sampler, BASE, N_DRAWS), 4)
    expected = torch.softmax(BASE / 0.5, dim=-1).tolist()
    # softmax([4, 2, 0, -2]) = [0.865, 0.117, 0.016, 0.002]
    assert expected[0] == pytest.approx(0.8650, abs=1e-3)
    assert observed == pytest.approx(expected, abs=TOLERANCE)
    assert observed[0] > 0.644 + 0.15  # well above its share at temperature 1


def test_high_temperature_flattens() -> None:
    sampler = Sampler(SamplingParams(temperature=2.0, seed=7), vocab_size=4)
    observed = frequencies(draws(sampler, BASE, N_DRAWS), 4)
    expected = torch.softmax(BASE / 2.0, dim=-1).tolist()
    assert observed == pytest.approx(expected, abs=TOLERANCE)
    assert observed[0] < 0.644 - 0.15


@pytest.mark.parametrize("temperature", [0.1, 1.0, 2.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=3), vocab_size=4)
    assert set(draws(sampler, SHUFFLED, 300)) == {2}


def test_top_k_two_draws_only_the_top_two() -> None:
    sampler = Sampler(SamplingParams(temperature=100.0, top_k=2, seed=3), vocab_size=4)
    assert set(draws(sampler, SHUFFLED, 300)) == {0, 2}


def test_top_p_limits_the_draws() -> None:
    sampler = Sampler(SamplingParams(top_p=0.7, seed=3), vocab_size=4)
    tokens = draws(sampler, SHUFFLED, 2000)
    assert set(tokens) == {0, 2}
    # Renormalised over the two kept tokens: 0.5 / 0.8 and 0.3 / 0.8.
    assert frequencies(tokens, 4)[2] == pytest.approx(0.625, abs=TOLERANCE)


def test_min_p_limits_the_draws() -> None:
    sampler = Sampler(SamplingParams(min_p=0.2, seed=3), vocab_size=4)
    assert set(draws(sampler, SHUFFLED, 2000)) == {0, 2, 3}


def test_logit_bias_can_ban_and_force_a_token() -> None:
    banned = Sampler(SamplingParams(logit_bias={2: -100.0}, seed=5), vocab_size=4)
    assert 2 not in draws(banned, SHUFFLED, 1000)
    forced = Sampler(SamplingParams(logit_bias={1: 100.0}, seed=5), vocab_size=4)
    assert set(draws(forced, SHUFFLED, 200)) == {1}


# --- Sampler: penalties ------------------------------------------------------------------


def test_frequency_penalty_changes_the_choice_as_tokens_are_sampled() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0), vocab_size=3)
    logits = torch.tensor([3.0, 2.5, 0.0])
    # 3 > 2.5 -> 0;  then 2 < 2.5 -> 1;  then 2 > 1.5 -> 0;  then 1 < 1.5 -> 1
    assert draws(sampler, logits, 4) == [0, 1, 0, 1]


def test_presence_penalty_counts_a_token_once() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0), vocab_size=3)
    logits = torch.tensor([3.0, 1.5, 0.0])
    # After 0 is seen it scores 2.0, still above 1.5, however often it repeats.
    assert draws(sampler, logits, 4) == [0, 0, 0, 0]


def test_observed_history_penalises_before_the_first_sample() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    logits = torch.tensor([3.0, 2.5, 0.0])
    fresh = Sampler(params, vocab_size=3)
    assert fresh.sample(logits) == 0
    replayed = Sampler(params, vocab_size=3)
    replayed.observe(0)  # 3 - 0.4 = 2.6: still ahead
    assert replayed.sample(logits) == 0
    replayed = Sampler(params, vocab_size=3)
    replayed.observe(0)
    replayed.observe(0)  # 3 - 0.8 = 2.2: now behind 2.5
    assert replayed.sample(logits) == 1


def test_penalties_do_not_modify_the_callers_logits() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0), vocab_size=3)
    logits = torch.tensor([3.0, 2.5, 0.0])
    draws(sampler, logits, 3)
    assert logits.tolist() == [3.0, 2.5, 0.0]
