"""Which variant of a model a node without its layers routes through (`choose_variant`)."""

from __future__ import annotations

import pytest

from swarmd.dht.records import NodeRecord
from swarmd.errors import ModelNotFoundError
from swarmd.model.common import Variant
from swarmd.pipeline.variants import choose_variant
from tests.unit.test_route import MODEL, L, record

A, B = "a" * 64, "b" * 64  # two content ids


def held(peer: str, start: int, end: int, content: str, **changes: object) -> NodeRecord:
    return record(peer, start, end, 10.0, model_hash=content, **changes)


def test_the_variant_whose_holders_cover_every_layer_wins_over_a_more_popular_one() -> None:
    records = [
        held("P1", 0, 10, A),
        held("P2", 0, 10, A),
        held("P3", 10, 20, A),  # A: three holders, layers 20:30 missing
        held("Q1", 0, 15, B),
        held("Q2", 15, L, B),
    ]
    assert choose_variant(MODEL, records, []) == Variant(B, "fp32", "float16")


def test_between_whole_variants_the_most_holders_then_the_lowest_fields_win() -> None:
    two = [held("P1", 0, L, A), held("Q1", 0, L, B), held("Q2", 0, L, B)]
    assert choose_variant(MODEL, two, []).content_id == B
    tie = [held("Q1", 0, L, B), held("P1", 0, L, A)]
    assert choose_variant(MODEL, tie, []).content_id == A
    # The same content held in other weights or dtype is another variant: never mixed.
    formats = [held("P1", 0, 15, A), held("P2", 15, L, A, weights="int4")]
    with_whole = [*formats, held("P3", 15, L, A)]
    assert choose_variant(MODEL, with_whole, []) == Variant(A, "fp32", "float16")


def test_draining_and_other_models_records_do_not_count() -> None:
    records = [
        held("P1", 0, L, A, state="draining"),
        held("P2", 0, L, A, model_id="another"),
        held("Q1", 0, L, B),
    ]
    assert choose_variant(MODEL, records, []).content_id == B


@pytest.mark.parametrize(
    ("records", "says"),
    [
        ([], "no peer of the swarm serves it"),
        ([record("P1", 0, L, 1.0)], "without a manifest"),  # a plain folder: no content id
    ],
)
def test_a_model_without_a_manifested_holder_is_not_found_and_says_why(
    records: list[NodeRecord], says: str
) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        choose_variant(MODEL, records, ["mine"])
    assert says in str(caught.value) and "mine" in str(caught.value)
