"""Whether this node can route a model, and through which holders: one answer for
`/v1/models` and for the diagnostics report (they used to disagree on a model served
without a manifest, which is forwarded to a whole holder, never routed in stages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd.dht.records import NodeRecord
from swarmd.errors import ModelNotFoundError
from swarmd.model.common import Variant
from swarmd.pipeline.variants import choose_variant

if TYPE_CHECKING:
    from swarmd.node import Node


@dataclass(frozen=True)
class RouteHolders:
    variant: Variant | None  # None: served without a manifest (forwarded, never staged)
    holders: list[NodeRecord]  # the ready holders a route would be planned from
    can_route: bool  # False: nothing here could take a request for it at all


def route_holders(node: Node, model_id: str, ready: list[NodeRecord]) -> RouteHolders:
    """For a model this node holds no layers of, from its ready holders' records."""
    try:
        variant = choose_variant(model_id, ready, node.model_ids)
    except ModelNotFoundError:  # served without a manifest: forwarded to a whole holder
        return RouteHolders(None, ready, bool(node.forward_candidates(ready)))
    chosen = [r for r in ready if r.model_hash == variant.content_id]
    return RouteHolders(variant, chosen, True)


def merge_ranges(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Union of half-open ranges, sorted: [(0,10),(5,20),(25,30)] -> [[0,20],[25,30]]."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(num_layers: int, holders: dict[str, tuple[int, int]], banned: set[str]) -> bool:
    """Whether the holders this node may use (banned peers left out) cover every layer."""
    usable = merge_ranges([r for p, r in holders.items() if p not in banned])
    return usable == [[0, num_layers]]
