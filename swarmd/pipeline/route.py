"""Route planning: which peers run which layers of one request (pure, no I/O).

`plan_route` picks a `Route`: `Stage`s whose layer ranges cover ``[0, num_layers)``
once and in order, each with a `standby` peer holding the same range. `replan` swaps
out a failed stage and re-routes only its range (STYLE habit 8). Both raise
`NoRouteError` naming the uncovered layers when no eligible holder serves them.

Inputs are `Candidate`s (or `NodeRecord`s, turned into candidates here): a peer, the
layers ``[start, end)`` it holds, its seconds per layer per token and its free KV
tokens. A peer's cost per layer is what this node measured of it (`layer_ms`, from the
decode steps its routes ran there) when it has measured it; a record's self-reported
throughput is only the prior for a peer never used. A holder is skipped when banned or
when its free KV tokens are below what the session needs; a record is skipped unless it
is ``ready`` and of this model.

Cost model, estimated seconds per token::

    stage  = layers x layer_cost_s + rtt(peer)      rtt(this node) = 0
    route  = sum of its stages

A token goes round a ring: coordinator -> stage 0 -> ... -> last stage -> coordinator.
The peer table only measures round trips from this node, so a hop p -> q is estimated
as rtt(p)/2 + rtt(q)/2 (the bound through this node); a hop with this node at one end
costs the other end's rtt/2, and 0 when this node is at both. Summed over the ring each
stage pays its own peer's whole rtt, so a stage's cost does not depend on its
neighbours and planning is a shortest path over layer boundaries (the starts and ends
of every holder's range); an edge is (peer, a, b) with [a, b) inside what the peer
holds, so a peer may serve part of its range. Costs are whole nanoseconds, so sums are
exact and equal costs really tie.

A peer appears at most once in a route (each stage keeps one KV cache per session).
The search first allows repeats, which is a plain shortest path. When the best route
so found repeats peers (say a fast peer inside this node's range: here, there, here
again) it searches again, now remembering in each state which of those "watched" peers
were used and still hold layers past the boundary, and adds any newly repeated peer
to the watched ones until the best route repeats none; that route is the best of all.
The states kept per boundary are capped (`max_states_per_boundary`, the cheapest
stay); past the cap the answer may not be the cheapest, but one is still found when the
layers are covered: a used peer that blocks a boundary was offered its whole range from
where it started, so the search always gets past that boundary.

Choice: the lowest cost plus `hop_penalty_s` per remote stage, so a route with more
hops must beat one with fewer by more than that (fewer hops to fail); then, on an
exact tie, more layers on this node; then the smallest sequence of (peer id, start,
end), so the result does not depend on the input order. `est_s` leaves the penalty out.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from swarmd.dht.records import NodeRecord
from swarmd.errors import NoRouteError
from swarmd.model.layers import LayerRange
from swarmd.pipeline.placement import coverage, gaps

__all__ = [
    "Candidate",
    "Route",
    "RouteConfig",
    "Stage",
    "candidates_from_records",
    "plan_route",
    "replan",
]

_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000
_MAX_NS = 10**15  # a cost cap (about 11 days) so absurd inputs stay integers


@dataclass(frozen=True)
class RouteConfig:
    default_layer_cost_s: float = 0.005  # per layer per token, for an unmeasured holder
    default_rtt_ms: float = 50.0  # for a peer the peer table has no round trip for
    hop_penalty_s: float = 0.001  # charged per remote stage when choosing, not in est_s
    max_states_per_boundary: int = 32  # width of the no-repeat search; bounds its work

    def __post_init__(self) -> None:
        for name in ("default_layer_cost_s", "default_rtt_ms", "hop_penalty_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"RouteConfig.{name} must be finite and >= 0, got {value}")
        if self.max_states_per_boundary < 1:
            raise ValueError("RouteConfig.max_states_per_boundary must be >= 1")


@dataclass(frozen=True)
class Candidate:
    """One peer that holds layers [start, end) of the model, as the planner sees it."""

    peer_id: str
    start: int  # first layer held
    end: int  # one past the last layer held
    layer_cost_s: float  # seconds per layer per token
    free_kv_tokens: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"candidate {self.peer_id}: empty range {self.start}:{self.end}")
        if not (math.isfinite(self.layer_cost_s) and self.layer_cost_s >= 0):
            raise ValueError(f"candidate {self.peer_id}: bad layer cost {self.layer_cost_s}")

    @classmethod
    def from_record(cls, record: NodeRecord, default_layer_cost_s: float) -> Candidate:
        """The record's range; its throughput over that range gives the per-layer cost."""
        layers = record.layer_end - record.layer_start
        tps = record.throughput_tps
        if tps > 0 and math.isfinite(tps):
            cost = min(1.0 / (tps * layers), _MAX_NS / _NS_PER_S)
        else:  # 0 = not measured yet
            cost = default_layer_cost_s
        return cls(
            record.peer_id, record.layer_start, record.layer_end, cost, record.free_kv_tokens
        )


def candidates_from_records(
    records: Iterable[NodeRecord],
    model_id: str,
    num_layers: int,
    config: RouteConfig = RouteConfig(),
) -> list[Candidate]:
    """Candidates from the records that are ``ready`` and of this model (id and size)."""
    return [
        Candidate.from_record(r, config.default_layer_cost_s)
        for r in records
        if r.state == "ready" and r.model_id == model_id and r.num_layers == num_layers
    ]


@dataclass(frozen=True)
class Stage:
    peer_id: str
    start: int  # first layer this stage runs
    end: int  # one past its last layer
    local: bool  # this node runs it
    standby: str | None  # another eligible holder of exactly [start, end), not in the route
    est_s: float  # estimated seconds per token: compute + the peer's round trip

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.start, self.end)


@dataclass(frozen=True)
class Route:
    model_id: str
    num_layers: int
    local_peer_id: str  # the coordinator
    stages: tuple[Stage, ...]  # cover [0, num_layers) once, in order

    @property
    def est_s(self) -> float:
        """Estimated seconds per token for the whole ring."""
        return sum(stage.est_s for stage in self.stages)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(stage.peer_id for stage in self.stages)

    @property
    def is_local(self) -> bool:
        """True when this node runs every layer itself."""
        return all(stage.local for stage in self.stages)


# A planned stage before standbys: (peer id, start, end); compared as tuples for ties.
_Pick = tuple[str, int, int]
# A search state's value: (cost ns + hop penalties, -layers on this node, stages so far).
_Key = tuple[int, int, tuple[_Pick, ...]]


def plan_route(
    model_id: str,
    num_layers: int,
    local_peer_id: str,
    candidates: Iterable[Candidate | NodeRecord],
    *,
    rtt_ms: Mapping[str, float] | None = None,
    layer_ms: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    need_tokens: int = 0,
    config: RouteConfig = RouteConfig(),
) -> Route:
    """The cheapest route over every layer; NoRouteError names the layers nobody serves.

    `rtt_ms` maps peer ids to measured round trips (missing: `config.default_rtt_ms`),
    `layer_ms` to measured milliseconds per layer per token (missing: the record's);
    `banned` peers and holders with fewer than `need_tokens` free KV tokens are skipped.
    """
    if num_layers < 1:
        raise ValueError(f"a model has at least one layer, got {num_layers}")
    planner = _Planner(
        model_id,
        num_layers,
        local_peer_id,
        candidates,
        rtt_ms,
        layer_ms,
        banned,
        need_tokens,
        config,
    )
    picks = planner.search(0, num_layers, frozenset())
    if picks is None:
        missing = planner.missing()
        held_by_avoided = [
            c for c in planner.avoided if any(c.start < b and c.end > a for a, b in missing)
        ]
        raise NoRouteError(model_id, missing, avoided=len(held_by_avoided))
    return planner.route(picks, {})


def replan(
    route: Route,
    failed_peer_id: str,
    candidates: Iterable[Candidate | NodeRecord],
    *,
    rtt_ms: Mapping[str, float] | None = None,
    layer_ms: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    need_tokens: int = 0,
    config: RouteConfig = RouteConfig(),
) -> Route:
    """`route` with the failed peer's stage replaced and every other stage kept.

    The failed peer joins `banned`. Its range goes to the stage's standby when that is
    still eligible, else to the cheapest holders of that range outside the route (maybe
    several). When only peers already in the route hold it, the whole route is planned
    again; NoRouteError when nobody eligible holds some layer. Standbys are picked anew.
    A failed peer that runs no stage leaves the stages as they are.
    """
    planner = _Planner(
        route.model_id,
        route.num_layers,
        route.local_peer_id,
        candidates,
        rtt_ms,
        layer_ms,
        {*banned, failed_peer_id},
        need_tokens,
        config,
    )
    kept = {s.peer_id: s.est_s for s in route.stages if s.peer_id != failed_peer_id}
    exclude = frozenset(kept)
    picks: list[_Pick] = []
    for stage in route.stages:
        if stage.peer_id != failed_peer_id:
            picks.append((stage.peer_id, stage.start, stage.end))
            continue
        standby = stage.standby
        if standby is not None and planner.holds(standby, stage.start, stage.end, exclude):
            picks.append((standby, stage.start, stage.end))
            continue
        found = planner.search(stage.start, stage.end, exclude)
        if found is None:  # only route members hold it, or nobody: start over
            return plan_route(
                route.model_id,
                route.num_layers,
                route.local_peer_id,
                planner.eligible,
                rtt_ms=rtt_ms,
                layer_ms=layer_ms,
                config=config,
            )
        picks.extend(found)
    return planner.route(picks, kept)


class _Planner:
    """The eligible candidates of one request and the costs of serving layers on them."""

    def __init__(
        self,
        model_id: str,
        num_layers: int,
        local_peer_id: str,
        candidates: Iterable[Candidate | NodeRecord],
        rtt_ms: Mapping[str, float] | None,
        layer_ms: Mapping[str, float] | None,
        banned: Collection[str],
        need_tokens: int,
        config: RouteConfig,
    ) -> None:
        self.model_id = model_id
        self.num_layers = num_layers
        self.local_peer_id = local_peer_id
        self.config = config
        self._rtt_ms = rtt_ms or {}
        self.avoided: list[Candidate] = []  # banned holders (a NoRouteError names them)
        by_peer: dict[str, Candidate] = {}
        for item in candidates:
            if isinstance(item, NodeRecord):
                usable = candidates_from_records([item], model_id, num_layers, config)
                if not usable:
                    continue
                item = usable[0]
            if item.peer_id in banned:
                self.avoided.append(item)
                continue
            if item.free_kv_tokens < need_tokens:
                continue
            if item.start >= num_layers:
                continue
            item = dataclasses.replace(item, end=min(item.end, num_layers))
            measured = (layer_ms or {}).get(item.peer_id)
            if measured is not None and math.isfinite(measured) and measured >= 0:
                cost = min(measured / 1000.0, _MAX_NS / _NS_PER_S)
                item = dataclasses.replace(item, layer_cost_s=cost)
            # One record per peer and model is the rule; for duplicates keep one, the
            # same whatever the input order.
            held = by_peer.get(item.peer_id)
            if held is None or _dup_order(item) < _dup_order(held):
                by_peer[item.peer_id] = item
        self.eligible: list[Candidate] = [by_peer[p] for p in sorted(by_peer)]
        self._ends = {c.peer_id: c.end for c in self.eligible}

    # --- costs ------------------------------------------------------------------------

    def _link_ns(self, peer_id: str) -> int:
        if peer_id == self.local_peer_id:
            return 0
        rtt = self._rtt_ms.get(peer_id)
        if rtt is None or not math.isfinite(rtt) or rtt < 0:
            rtt = self.config.default_rtt_ms
        return min(round(rtt * _NS_PER_MS), _MAX_NS)

    def _layer_ns(self, cand: Candidate) -> int:
        return min(round(cand.layer_cost_s * _NS_PER_S), _MAX_NS)

    def cost_ns(self, cand: Candidate, start: int, end: int) -> int:
        """Estimated ns per token for `cand` to run [start, end), its round trip included."""
        return (end - start) * self._layer_ns(cand) + self._link_ns(cand.peer_id)

    # --- queries ----------------------------------------------------------------------

    def holds(self, peer_id: str, start: int, end: int, exclude: frozenset[str]) -> bool:
        """Whether `peer_id` is eligible, outside `exclude`, and holds [start, end)."""
        return peer_id not in exclude and any(
            c.peer_id == peer_id and c.start <= start and end <= c.end for c in self.eligible
        )

    def missing(self) -> list[tuple[int, int]]:
        """The merged ranges of the model that no eligible candidate holds."""
        held = (LayerRange(c.start, c.end) for c in self.eligible)
        return [(g.start, g.end) for g in gaps(coverage(self.num_layers, held))]

    def search(self, lo: int, hi: int, exclude: frozenset[str]) -> list[_Pick] | None:
        """The best stages over [lo, hi) with peers outside `exclude`; None if uncovered."""
        cands = [
            c for c in self.eligible if c.peer_id not in exclude and c.start < hi and c.end > lo
        ]
        # Constraint generation: watch only the peers a found route repeats, until none
        # does. The answer is the best with no watched peer repeated, so the best of all.
        watched: frozenset[str] = frozenset()
        while True:
            found = self._search(lo, hi, cands, watched)
            if found is None:
                return None
            peers = [peer for peer, _, _ in found]
            repeated = {peer for peer in peers if peers.count(peer) > 1}
            if not repeated:
                return found
            watched |= repeated

    def _search(
        self, lo: int, hi: int, cands: list[Candidate], watched: frozenset[str]
    ) -> list[_Pick] | None:
        bounds = sorted({lo, hi} | {min(max(x, lo), hi) for c in cands for x in (c.start, c.end)})
        penalty_ns = round(self.config.hop_penalty_s * _NS_PER_S)
        edges = []  # per candidate: (candidate, layer ns, fixed ns, is local)
        for c in cands:
            local = c.peer_id == self.local_peer_id
            fixed = self._link_ns(c.peer_id) + (0 if local else penalty_ns)
            edges.append((c, self._layer_ns(c), fixed, local))
        # states[b][used watched peers whose range reaches past b] = best key reaching b
        states: dict[int, dict[frozenset[str], _Key]] = {b: {} for b in bounds}
        states[lo][frozenset()] = (0, 0, ())
        for i, a in enumerate(bounds[:-1]):
            for used, (cost, neg_local, path) in self._prune(states[a]):
                for cand, layer_ns, fixed_ns, local in edges:
                    if not cand.start <= a < cand.end or cand.peer_id in used:
                        continue
                    last = bisect.bisect_right(bounds, min(cand.end, hi))
                    for b in bounds[i + 1 : last]:
                        key: _Key = (
                            cost + (b - a) * layer_ns + fixed_ns,
                            neg_local - (b - a if local else 0),
                            (*path, (cand.peer_id, a, b)),
                        )
                        reach = used
                        if cand.peer_id in watched or used:
                            reach = frozenset(
                                p
                                for p in (*used, cand.peer_id)
                                if p in watched and self._ends[p] > b
                            )
                        best = states[b].get(reach)
                        if best is None or key < best:
                            states[b][reach] = key
        if not states[hi]:
            return None
        return list(min(states[hi].values())[2])

    def _prune(self, layer: dict[frozenset[str], _Key]) -> list[tuple[frozenset[str], _Key]]:
        """The cheapest states of one boundary, at most `max_states_per_boundary`."""
        items = sorted(layer.items(), key=lambda kv: (kv[1], sorted(kv[0])))
        return items[: self.config.max_states_per_boundary]

    # --- the result -------------------------------------------------------------------

    def route(self, picks: list[_Pick], known_est_s: Mapping[str, float]) -> Route:
        """Stages for `picks`, each with its standby; `known_est_s` for kept stages."""
        in_route = frozenset(peer for peer, _, _ in picks)
        stages = []
        for peer, start, end in picks:
            cand = next((c for c in self.eligible if c.peer_id == peer), None)
            if cand is not None:
                est_s = self.cost_ns(cand, start, end) / _NS_PER_S
            else:  # a kept stage whose holder is no longer listed
                est_s = known_est_s.get(peer, 0.0)
            stages.append(
                Stage(
                    peer_id=peer,
                    start=start,
                    end=end,
                    local=peer == self.local_peer_id,
                    standby=self._standby(start, end, in_route),
                    est_s=est_s,
                )
            )
        return Route(self.model_id, self.num_layers, self.local_peer_id, tuple(stages))

    def _standby(self, start: int, end: int, in_route: frozenset[str]) -> str | None:
        options = [
            (self.cost_ns(c, start, end), c.peer_id != self.local_peer_id, c.peer_id)
            for c in self.eligible
            if c.peer_id not in in_route and c.start <= start and end <= c.end
        ]
        return min(options)[2] if options else None


def _dup_order(cand: Candidate) -> tuple[int, float, int, int]:
    return (-(cand.end - cand.start), cand.layer_cost_s, -cand.free_kv_tokens, cand.start)
