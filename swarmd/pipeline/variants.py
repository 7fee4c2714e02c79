"""Which way of holding a model a node coordinates it through, when it holds none of it.

Holders of one model id may hold different content (another shard split or conversion),
other weight formats or compute dtypes; a hidden state means nothing across them, so a
route keeps to one `Variant`. A coordinator without layers picks the variant whose
holders cover every layer, then the one with most holders; ties go by the variant's own
fields, so every such coordinator of a swarm picks the same one (and gives the same
greedy reply).
"""

from __future__ import annotations

from swarmd.dht.records import NodeRecord
from swarmd.errors import ModelNotFoundError
from swarmd.model.common import Variant
from swarmd.pipeline.placement import coverage, gaps


def choose_variant(model_id: str, records: list[NodeRecord], known: list[str]) -> Variant:
    """The variant of `model_id` to route through; ModelNotFoundError (naming `known`,
    the models this node serves) when no ready holder announces a content id."""
    ready = [r for r in records if r.state == "ready" and r.model_id == model_id]
    groups: dict[Variant, list[NodeRecord]] = {}
    for record in ready:
        if record.model_hash:
            key = Variant(record.model_hash, record.weights, record.dtype)
            groups.setdefault(key, []).append(record)
    if not groups:
        hint = (
            f": {len(ready)} peer(s) serve it from a Hugging Face folder, without a "
            "manifest, so this node cannot take its tokenizer; ask one of them directly"
            if ready
            else ": no peer of the swarm serves it"
        )
        raise ModelNotFoundError(model_id, known, hint=hint)

    def rank(item: tuple[Variant, list[NodeRecord]]) -> tuple[bool, int, str, str, str]:
        variant, holders = item
        whole = not gaps(coverage(holders[0].num_layers, (r.layers for r in holders)))
        peers = len({r.peer_id for r in holders})
        return (not whole, -peers, variant.content_id, variant.weights, variant.dtype_name)

    return min(groups.items(), key=rank)[0]
