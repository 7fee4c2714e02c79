"""Layer placement for `--layers auto`: coverage, gaps, apportionment, the chosen range."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from swarmd.errors import ConfigError
from swarmd.model.layers import LayerRange
from swarmd.pipeline.placement import (
    Placement,
    choose_layers,
    coverage,
    gaps,
    split_largest_remainder,
)

L = 30
MB = 1_000_000


def R(start: int, end: int) -> LayerRange:
    return LayerRange(start, end)


def equal(n: int = L, each: int = MB) -> list[int]:
    return [each] * n


def join_one_by_one(layer_bytes: list[int], budget: int, max_nodes: int) -> list[LayerRange]:
    """Nodes with the same budget join an empty swarm until every layer is served."""
    held: list[LayerRange] = []
    while 0 in coverage(len(layer_bytes), held):
        assert len(held) < max_nodes, f"more than {max_nodes} nodes: {held}"
        held.append(choose_layers(len(layer_bytes), layer_bytes, iter(held), budget).layers)
    return held


# --- coverage ---------------------------------------------------------------------------


def test_coverage_counts_overlapping_holders():
    assert coverage(10, [R(0, 5), R(3, 8), R(4, 5)]) == [1, 1, 1, 2, 3, 1, 1, 1, 0, 0]


def test_coverage_clips_ranges_to_the_model():
    assert coverage(5, [R(3, 9), R(7, 12)]) == [0, 0, 0, 1, 1]


def test_coverage_of_an_empty_swarm_is_all_zero():
    assert coverage(4, []) == [0, 0, 0, 0]


# --- gaps -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ([0, 0, 1, 1], [R(0, 2)]),  # at the start
        ([1, 0, 0, 2, 1], [R(1, 3)]),  # in the middle
        ([1, 1, 0], [R(2, 3)]),  # at the end
        ([0, 1, 0, 0, 2, 0], [R(0, 1), R(2, 4), R(5, 6)]),  # several, in order
        ([1, 2, 1], []),  # none
        ([0, 0, 0], [R(0, 3)]),  # nothing served
    ],
)
def test_gaps_are_maximal_runs_of_zero(counts, expected):
    assert gaps(counts) == expected


# --- split_largest_remainder ------------------------------------------------------------


def test_split_equal_weights_gives_the_extra_unit_to_the_first():
    assert split_largest_remainder(10, [1.0, 1.0, 1.0]) == [4, 3, 3]


def test_split_exact_quotas_need_no_remainder():
    # quotas 7*1/7, 7*2/7, 7*4/7 are whole: 1, 2, 4
    assert split_largest_remainder(7, [1, 2, 4]) == [1, 2, 4]


def test_split_hands_leftovers_to_the_largest_remainders():
    # quotas 10/7=1.43, 20/7=2.86, 40/7=5.71 -> floors 1+2+5=8; the 2 left go to .86 and .71
    assert split_largest_remainder(10, [1, 2, 4]) == [1, 3, 6]


def test_split_ties_go_to_the_lower_index():
    # quotas are all 2/3: floors 0, both units go to the first two
    assert split_largest_remainder(2, [1, 1, 1]) == [1, 1, 0]


def test_split_zero_weight_gets_nothing_and_zero_total_gives_zeros():
    assert split_largest_remainder(5, [0, 3, 0, 2]) == [0, 3, 0, 2]
    assert split_largest_remainder(0, [1, 2]) == [0, 0]


def test_split_always_sums_to_total():
    rng = random.Random(7)
    for _ in range(500):
        weights = [rng.random() * rng.choice([1, 1e-6, 1e6]) for _ in range(rng.randint(1, 9))]
        total = rng.randint(0, 200)
        shares = split_largest_remainder(total, weights)
        assert sum(shares) == total
        # Hamilton's quota rule: each share is the floor or the ceiling of its quota.
        for share, w in zip(shares, weights, strict=True):
            quota = total * Fraction(w) / sum(map(Fraction, weights))
            assert math.floor(quota) <= share <= math.ceil(quota)


@pytest.mark.parametrize(
    ("total", "weights"),
    [
        (3, []),
        (3, [1.0, -1.0]),
        (3, [1.0, math.nan]),
        (3, [math.inf, 1.0]),
        (3, [0.0, 0.0]),
        (-1, [1.0]),
    ],
)
def test_split_rejects_bad_input(total, weights):
    with pytest.raises(ValueError):
        split_largest_remainder(total, weights)


# --- choose_layers: gaps ----------------------------------------------------------------


def test_picks_the_uncovered_tail():
    placed = choose_layers(L, equal(), [R(0, 10), R(10, 20)], budget_bytes=100 * MB)
    assert isinstance(placed, Placement)
    assert placed.layers == R(20, 30)
    assert "20:30" in placed.reason
    assert "served by nobody" in placed.reason
    assert "budget" in placed.reason


def test_picks_the_larger_of_two_gaps():
    # gaps 20:22 (2 layers) and 25:30 (5 layers)
    placed = choose_layers(L, equal(), [R(0, 20), R(22, 25)], budget_bytes=100 * MB)
    assert placed.layers == R(25, 30)
    assert "largest of 2 gaps" in placed.reason


def test_equal_gaps_pick_the_heavier_then_the_lower_start():
    held = [R(5, 25)]  # gaps 0:5 and 25:30, both 5 layers
    heavy_tail = equal()
    heavy_tail[-1] = 3 * MB  # the LM head
    assert choose_layers(L, heavy_tail, held, 100 * MB).layers == R(25, 30)
    assert choose_layers(L, equal(), held, 100 * MB).layers == R(0, 5)


def test_first_node_with_room_for_everything_takes_the_whole_model():
    placed = choose_layers(L, equal(), [], budget_bytes=30 * MB)
    assert placed.layers == R(0, 30)
    assert "0:30" in placed.reason
    assert "a budget of 30.0 MB holds all of it" in placed.reason


def test_first_node_takes_the_first_of_three_even_parts():
    placed = choose_layers(L, equal(), [], budget_bytes=12 * MB)  # room for 12 of 30
    assert placed.layers == R(0, 10)
    assert "split over 3 budgets like this one" in placed.reason
    assert "10+10+10" in placed.reason
    assert "0:10" in placed.reason
    assert "budget" in placed.reason


def test_first_node_takes_the_first_of_two_even_parts():
    placed = choose_layers(L, equal(), [], budget_bytes=15 * MB)  # room for exactly 15
    assert placed.layers == R(0, 15)
    assert "15+15" in placed.reason


def test_heavy_embeddings_force_more_parts():
    layer_bytes = equal()
    layer_bytes[0] = 6 * MB  # embeddings folded into layer 0: 35 MB in all
    # 3 parts (10 layers) would put 15 MB in the first, 4 parts (8) 13 MB; 5 parts fit.
    placed = choose_layers(L, layer_bytes, [], budget_bytes=12 * MB)
    assert placed.layers == R(0, 6)
    assert "split over 5 budgets" in placed.reason
    assert "6+6+6+6+6" in placed.reason


def test_split_continues_where_the_previous_node_stopped():
    placed = choose_layers(L, equal(), [R(0, 10)], budget_bytes=12 * MB)
    assert placed.layers == R(10, 20)  # the 20-layer gap, split 10+10


def test_nodes_joining_one_by_one_tile_the_model_without_overlap():
    layer_bytes = equal()
    layer_bytes[0] += 5 * MB  # embeddings
    layer_bytes[-1] += 5 * MB  # LM head
    held = join_one_by_one(layer_bytes, budget=12 * MB, max_nodes=5)
    assert coverage(L, held) == [1] * L
    assert all(sum(layer_bytes[r.start : r.end]) <= 12 * MB for r in held)
    assert [r.start for r in held] == sorted(r.start for r in held)


def test_budget_too_small_for_one_layer_names_the_layer_and_both_sizes():
    with pytest.raises(ConfigError) as err:
        choose_layers(L, equal(each=57_200_000), [], budget_bytes=50 * MB)
    message = str(err.value)
    assert "Layer 0" in message
    assert "57.2 MB" in message
    assert "50.0 MB" in message


def test_budget_too_small_names_the_first_layer_of_the_gap():
    layer_bytes = equal()
    layer_bytes[10] = 2 * MB
    with pytest.raises(ConfigError, match=r"Layer 10 alone needs 2\.0 MB.*1\.0 MB"):
        choose_layers(L, layer_bytes, [R(0, 10)], budget_bytes=MB)


def test_a_later_layer_over_the_budget_cuts_the_target_before_it():
    layer_bytes = equal(10)
    layer_bytes[9] = 5 * MB  # an LM head no budget like this one can hold
    placed = choose_layers(10, layer_bytes, [], budget_bytes=3 * MB)
    # 0:9 is what such nodes can serve: 9 MB over 3 parts of 3 layers
    assert placed.layers == R(0, 3)
    assert "layer 9 alone needs 5.0 MB" in placed.reason
    assert "3+3+3" in placed.reason


def test_weightless_layers_fit_any_budget():
    assert choose_layers(4, [0, 0, 0, 0], [], budget_bytes=1).layers == R(0, 4)


@pytest.mark.parametrize(
    ("budget", "text"),
    [(999, "999 B"), (57_240_000, "57.2 MB"), (999_960, "1.0 MB"), (3 * 10**9, "3.0 GB")],
)
def test_reason_formats_the_budget_in_decimal_units(budget, text):
    assert f"a budget of {text}" in choose_layers(1, [1], [], budget).reason


# --- choose_layers: full coverage -------------------------------------------------------


def test_full_coverage_adds_a_holder_where_there_are_fewest():
    placed = choose_layers(L, equal(), [R(0, 30), R(10, 30)], budget_bytes=100 * MB)
    assert placed.layers == R(0, 10)
    assert "every layer is served" in placed.reason
    assert "layers 0:10 have the fewest holders (1)" in placed.reason
    assert "budget" in placed.reason


def test_full_coverage_prefers_the_longest_thin_run_then_the_lowest_start():
    assert choose_layers(L, equal(), [R(0, 30), R(0, 5)], 100 * MB).layers == R(5, 30)
    assert choose_layers(L, equal(), [R(0, 30), R(10, 20)], 100 * MB).layers == R(0, 10)


def test_full_coverage_splits_a_thin_run_like_a_gap():
    placed = choose_layers(L, equal(), [R(0, 30)], budget_bytes=12 * MB)
    assert placed.layers == R(0, 10)
    assert "10+10+10" in placed.reason


def test_held_ranges_past_the_model_are_ignored():
    placed = choose_layers(10, equal(10), [R(10, 40)], budget_bytes=100 * MB)
    assert placed.layers == R(0, 10)


# --- choose_layers: programming errors --------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "layer_bytes", "budget"),
    [
        (0, [], 10),  # no layers
        (3, [1, 1], 10),  # length mismatch
        (2, [1, -1], 10),  # negative bytes
        (2, [1, 1], 0),  # no budget
    ],
)
def test_bad_arguments_are_value_errors(num_layers, layer_bytes, budget):
    with pytest.raises(ValueError):
        choose_layers(num_layers, layer_bytes, [], budget)


def test_a_range_that_does_not_fit_names_every_number() -> None:
    from swarmd.model.memory import RUNTIME_FLOOR_BYTES, fit_error

    fits = fit_error("layers [0:4) of m", 1_000_000_000, 100_000_000, 2_000_000_000, "x")
    assert fits is None
    available = 1_000_000_000 + 100_000_000 + RUNTIME_FLOOR_BYTES - 1
    error = fit_error("layers [0:4) of m", 1_000_000_000, 100_000_000, available, "it has")
    assert error is not None
    assert "layers [0:4) of m needs 1.70 GB (weights 1.00 GB + KV cache" in error
    assert "it has 1.70 GB" in error
