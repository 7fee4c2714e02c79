"""`/v1/models` and the diagnostics report give one answer to "routable from this node"
(they disagreed on a model served without a manifest in two ranges: the report said yes,
while requests for it got 404; found by a stress run)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from swarmd.api.diagnostics import ModelRanges, _routable
from swarmd.dht.records import NodeRecord
from tests.unit.test_route import MODEL, L, record


def node(whole_holder: str | None = None) -> Any:
    def forward_candidates(records: list[NodeRecord]) -> list[NodeRecord]:
        return [r for r in records if r.peer_id == whole_holder]

    return SimpleNamespace(held={}, model_ids=[], forward_candidates=forward_candidates)


def routable(records: list[NodeRecord], banned: set[str], whole_holder: str | None = None) -> bool:
    held = ModelRanges(L, {r.peer_id: r.layers for r in records})
    return _routable(node(whole_holder), MODEL, held, records, banned)


def test_a_model_without_a_manifest_in_stages_is_not_routable() -> None:
    split = [record("A", 0, 15, 10.0), record("B", 15, L, 10.0)]
    assert not routable(split, set())  # stages of no content id: nothing to route
    assert routable([record("W", 0, L, 10.0)], set(), whole_holder="W")  # forwarded


def test_a_manifest_model_is_routable_while_its_usable_holders_cover_it() -> None:
    split = [record(p, a, b, 10.0, model_hash="c1") for p, a, b in (("A", 0, 15), ("B", 15, L))]
    assert routable(split, set())
    assert not routable(split, {"B"})  # banned: its layers are missing here
    other = record("C", 15, L, 10.0, model_hash="c2")  # another variant's stage
    assert not routable([split[0], other], set())
