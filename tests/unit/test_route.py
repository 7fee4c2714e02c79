"""The route planner: cover every layer once, cheapest first, standbys, re-routing."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from swarmd.dht.records import NodeRecord
from swarmd.errors import NoRouteError
from swarmd.pipeline.route import (
    Candidate,
    Route,
    RouteConfig,
    candidates_from_records,
    plan_route,
    replan,
)

L = 30
ME = "me"
MODEL = "smollm2-135m-instruct"


def cand(peer: str, start: int, end: int, ms_per_layer: float = 1.0, kv: int = 10_000):
    return Candidate(peer, start, end, ms_per_layer / 1000, kv)


def plan(cands, rtt=None, **kwargs) -> Route:
    return plan_route(MODEL, kwargs.pop("num_layers", L), ME, cands, rtt_ms=rtt or {}, **kwargs)


def shape(route: Route) -> list[tuple[str, int, int]]:
    return [(s.peer_id, s.start, s.end) for s in route.stages]


def record(peer: str, start: int, end: int, tps: float, **changes) -> NodeRecord:
    base = NodeRecord(
        peer_id=peer,
        model_id=MODEL,
        model_hash="",
        layer_start=start,
        layer_end=end,
        num_layers=L,
        dtype="float16",
        weights="fp32",
        free_kv_tokens=8192,
        kv_budget_tokens=8192,
        throughput_tps=tps,
        state="ready",
        addrs=(),
        api_url="",
        version="0.1.0",
        expires_at=0.0,
    )
    return dataclasses.replace(base, **changes)


# --- the basic shapes -------------------------------------------------------------------


def test_local_whole_holder_is_one_local_stage() -> None:
    route = plan([cand(ME, 0, L, 2.0)])
    assert shape(route) == [(ME, 0, L)]
    assert route.is_local and route.stages[0].local
    assert route.est_s == pytest.approx(0.060)  # 30 layers x 2 ms, no link
    assert route.stages[0].layers.size == L


def test_three_ranges_make_three_stages_in_order() -> None:
    cands = [cand("C", 20, 30), cand("A", 0, 10), cand("B", 10, 20)]
    route = plan(cands, rtt={"A": 4, "B": 6, "C": 8})
    assert shape(route) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    assert not route.is_local
    assert [s.est_s for s in route.stages] == pytest.approx([0.014, 0.016, 0.018])
    assert route.est_s == pytest.approx(0.048)


def test_overlapping_holders_cheaper_throughput_wins() -> None:
    # per-layer cost = 1 / (tps x layers held): 10 tok/s over 30 layers = 3.33 ms/layer
    slow, fast = record("A", 0, L, 10.0), record("B", 0, L, 20.0)
    rtt = {"A": 5, "B": 5}
    route = plan([slow, fast], rtt)
    assert shape(route) == [("B", 0, L)]
    assert route.est_s == pytest.approx(1 / 20 + 0.005)
    assert route.stages[0].standby == "A"
    swapped = [dataclasses.replace(slow, throughput_tps=30.0), fast]
    assert shape(plan(swapped, rtt)) == [("A", 0, L)]


def test_measured_speed_beats_what_a_record_claims() -> None:
    """A holder claiming 1,000 tok/s but measured at 5x its rival's ms per layer is not
    chosen; one never measured is judged by its record (the prior)."""
    liar, honest = record("A", 0, L, 1000.0), record("B", 0, L, 20.0)
    rtt = {"A": 5, "B": 5}
    assert shape(plan([liar, honest], rtt)) == [("A", 0, L)]  # unmeasured: the claim counts
    measured = {"A": 5 * 1.6, "B": 1.6}  # ms per layer per token
    route = plan([liar, honest], rtt, layer_ms=measured)
    assert shape(route) == [("B", 0, L)] and route.stages[0].standby == "A"
    assert route.est_s == pytest.approx(L * 0.0016 + 0.005)
    assert shape(plan([liar, honest], rtt, layer_ms={"A": 5 * 1.6})) == [("B", 0, L)]
    # Garbage in the measurements is ignored rather than trusted.
    assert shape(plan([liar, honest], rtt, layer_ms={"A": math.nan})) == [("A", 0, L)]


def test_replan_uses_measured_speed_for_the_replacement() -> None:
    cands = [cand("A", 0, 10), cand("B", 10, 20), cand("C", 20, 30), cand("D", 10, 20, 0.5)]
    cands.append(cand("E", 10, 20, 0.6))
    assert plan(cands, RTT_FLAT).stages[1].standby == "E"
    # E turned out slow when measured: B stands by for D, and takes over when D fails.
    route = plan(cands, RTT_FLAT, layer_ms={"E": 9.0})
    assert shape(route)[1] == ("D", 10, 20) and route.stages[1].standby == "B"
    new = replan(route, "D", cands, rtt_ms=RTT_FLAT, layer_ms={"E": 9.0})
    assert shape(new)[1] == ("B", 10, 20)


def test_rtt_trades_against_compute_both_ways() -> None:
    far, near = cand("FAR", 0, L, 1.0), cand("NEAR", 0, L, 3.0)
    # FAR: 30 ms + 100 ms = 130 ms; NEAR: 90 ms + 10 ms = 100 ms
    route = plan([far, near], {"FAR": 100, "NEAR": 10})
    assert shape(route) == [("NEAR", 0, L)]
    assert route.est_s == pytest.approx(0.100)
    # FAR: 30 ms + 40 ms = 70 ms beats NEAR's 100 ms
    route = plan([far, near], {"FAR": 40, "NEAR": 10})
    assert shape(route) == [("FAR", 0, L)]
    assert route.est_s == pytest.approx(0.070)


def test_unknown_rtt_uses_the_default() -> None:
    far, near = cand("FAR", 0, L, 1.0), cand("NEAR", 0, L, 3.0)
    # FAR unknown: 30 ms + default. NEAR: 90 ms + 10 ms.
    assert shape(plan([far, near], {"NEAR": 10}, config=RouteConfig(default_rtt_ms=50))) == [
        ("FAR", 0, L)
    ]
    assert shape(plan([far, near], {"NEAR": 10}, config=RouteConfig(default_rtt_ms=80))) == [
        ("NEAR", 0, L)
    ]


# --- ties -------------------------------------------------------------------------------


def test_local_wins_exact_ties() -> None:
    cands = [cand(ME, 0, L, 2.0), cand("R", 0, L, 2.0)]
    for order in (cands, cands[::-1]):
        assert shape(plan(order, {"R": 0})) == [(ME, 0, L)]
    # this node holds only [0,10): serve it here, A the rest (same cost as A whole)
    cands = [cand("A", 0, L, 1.0), cand(ME, 0, 10, 1.0)]
    for order in (cands, cands[::-1]):
        route = plan(order, {"A": 5})
        assert shape(route) == [(ME, 0, 10), ("A", 10, L)]
        assert route.est_s == pytest.approx(0.035)


def test_local_loses_when_clearly_slower() -> None:
    # 60 ms here against 30 ms there: not a tie, so the remote peer runs it
    route = plan([cand(ME, 0, L, 2.0), cand("R", 0, L, 1.0)], {"R": 0})
    assert shape(route) == [("R", 0, L)]
    assert route.stages[0].standby == ME


def test_near_ties_go_to_fewer_hops() -> None:
    whole = cand("A", 0, L, 1.0)  # 30 + 10 = 40 ms; A [0,15) or [15,30): 25 ms
    split = [cand("B", 0, 15, 0.6), cand("C", 15, L, 0.7)]  # 9 + 10.75 + 10.5 + 9.25 = 39.5
    rtt = {"A": 10, "B": 10.75, "C": 9.25}
    # 1 ms per remote stage: A 41 ms against B + C 41.5 ms
    route = plan([whole, *split], rtt, config=RouteConfig(hop_penalty_s=0.001))
    assert shape(route) == [("A", 0, L)]
    assert route.est_s == pytest.approx(0.040)  # the penalty is not in the estimate
    # 0.4 ms per remote stage: A 40.4 ms against B + C 40.3 ms
    route = plan([whole, *split], rtt, config=RouteConfig(hop_penalty_s=0.0004))
    assert shape(route) == [("B", 0, 15), ("C", 15, L)]
    assert route.est_s == pytest.approx(0.0395)


def test_equal_remote_peers_break_ties_by_peer_id() -> None:
    cands = [cand("peer-b", 0, L), cand("peer-a", 0, L), cand("peer-c", 0, L)]
    for order in itertools.permutations(cands):
        route = plan(list(order), {"peer-a": 5, "peer-b": 5, "peer-c": 5})
        assert shape(route) == [("peer-a", 0, L)]
        assert route.stages[0].standby == "peer-b"


# --- sub-ranges and peers used once -------------------------------------------------------


def test_local_serves_a_sub_range_of_its_holdings() -> None:
    # whole here: 90 ms; here [0,10) 30 ms + FAST [10,30) 20 ms + 5 ms = 55 ms
    route = plan([cand(ME, 0, L, 3.0), cand("FAST", 10, L, 1.0)], {"FAST": 5})
    assert shape(route) == [(ME, 0, 10), ("FAST", 10, L)]
    assert route.est_s == pytest.approx(0.055)


def test_remote_peer_serves_a_sub_range_of_its_holdings() -> None:
    # A [0,20) 25 ms + B [20,30) 25 ms = 50 ms, against A [0,10) + B [10,30) = 60 ms
    route = plan([cand("A", 0, 20, 1.0), cand("B", 10, L, 2.0)], {"A": 5, "B": 5})
    assert shape(route) == [("A", 0, 20), ("B", 20, L)]
    assert route.est_s == pytest.approx(0.050)


def test_a_peer_appears_once_in_a_route() -> None:
    # here [0,10) + FAST [10,20) + here [20,30) would cost 62 ms, but would use this
    # node twice; the only route without a repeat is this node whole (90 ms)
    route = plan([cand(ME, 0, L, 3.0), cand("FAST", 10, 20, 0.1)], {"FAST": 1})
    assert shape(route) == [(ME, 0, L)]
    assert route.stages[0].standby is None


# --- standbys ---------------------------------------------------------------------------


def test_standby_is_the_best_other_holder_of_the_exact_range() -> None:
    cands = [
        cand("A", 0, 10, 1.0),
        cand("B", 10, 20, 1.0),
        cand("C", 20, 30, 1.0),
        cand("S1", 10, 20, 3.0),  # holds B's range, dearer
        cand("S2", 5, 25, 2.0),  # holds B's range, cheaper than S1
        cand("X", 12, 30, 1.5),  # holds only part of B's range
    ]
    rtt = dict.fromkeys(["A", "B", "C", "S1", "S2", "X"], 5)
    route = plan(cands, rtt)
    assert shape(route)[1] == ("B", 10, 20)
    assert route.stages[1].standby == "S2"
    assert route.stages[0].standby is None  # nobody else holds [0,10)


def test_standby_ties_go_to_this_node_then_to_the_smaller_peer_id() -> None:
    cands = [cand("A", 0, L, 1.0), cand("S2", 0, L, 2.0), cand(ME, 0, L, 2.0)]
    rtt = {"A": 0, "S1": 0, "S2": 0}
    for order in itertools.permutations(cands):
        assert plan(list(order), rtt).stages[0].standby == ME
    cands = [cand("A", 0, L, 1.0), cand("S2", 0, L, 2.0), cand("S1", 0, L, 2.0)]
    for order in itertools.permutations(cands):
        assert plan(list(order), rtt).stages[0].standby == "S1"


def test_no_standby_when_nobody_else_holds_the_range() -> None:
    route = plan([cand("A", 0, 15), cand("B", 15, L), cand("C", 10, L, 5.0)], {"C": 0})
    assert shape(route) == [("A", 0, 15), ("B", 15, L)]
    assert [s.standby for s in route.stages] == [None, "C"]


def test_standby_is_never_a_peer_of_the_route() -> None:
    # B holds A's range too, but B already runs [10,30)
    route = plan([cand("A", 0, 10, 1.0), cand("B", 0, L, 2.0)], {"A": 1, "B": 1})
    assert shape(route) == [("A", 0, 10), ("B", 10, L)]
    assert route.stages[0].standby is None


# --- eligibility ------------------------------------------------------------------------


def test_banned_peer_is_skipped() -> None:
    cands = [cand("A", 0, L, 1.0), cand("B", 0, L, 2.0)]
    assert shape(plan(cands)) == [("A", 0, L)]
    route = plan(cands, banned={"A"})
    assert shape(route) == [("B", 0, L)]
    assert route.stages[0].standby is None  # a banned peer is no standby either


def test_holder_without_enough_free_kv_tokens_is_skipped() -> None:
    cands = [cand("A", 0, L, 1.0, kv=100), cand("B", 0, L, 2.0, kv=500)]
    assert shape(plan(cands, need_tokens=100)) == [("A", 0, L)]  # exactly enough
    assert shape(plan(cands, need_tokens=101)) == [("B", 0, L)]
    with pytest.raises(NoRouteError) as info:
        plan(cands, need_tokens=501)
    assert info.value.missing == [(0, L)]


def test_records_not_ready_or_of_another_model_are_skipped() -> None:
    good = record("A", 0, L, 10.0)
    records = [
        record("B", 0, L, 1000.0, state="loading"),
        record("C", 0, L, 1000.0, state="draining"),
        record("D", 0, L, 1000.0, model_id="other-model"),
        record("E", 0, 20, 1000.0, num_layers=20),
        good,
    ]
    assert shape(plan(records)) == [("A", 0, L)]
    assert [c.peer_id for c in candidates_from_records(records, MODEL, L)] == ["A"]


def test_unmeasured_throughput_uses_the_default_layer_cost() -> None:
    config = RouteConfig(default_layer_cost_s=0.004)
    [unmeasured] = candidates_from_records([record("A", 0, 10, 0.0)], MODEL, L, config)
    assert unmeasured.layer_cost_s == 0.004
    [measured] = candidates_from_records([record("A", 0, 10, 50.0)], MODEL, L, config)
    assert measured.layer_cost_s == pytest.approx(1 / 500)


# --- missing layers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranges", "missing"),
    [
        ([(0, 15), (20, 30)], [(15, 20)]),
        ([(0, 15)], [(15, 30)]),
        ([], [(0, 30)]),
        ([(5, 30)], [(0, 5)]),
        ([(0, 5), (3, 10), (20, 25)], [(10, 20), (25, 30)]),
    ],
)
def test_gaps_raise_no_route_naming_the_missing_layers(ranges, missing) -> None:
    cands = [cand(f"P{i}", a, b) for i, (a, b) in enumerate(ranges)]
    with pytest.raises(NoRouteError) as info:
        plan(cands)
    assert info.value.missing == missing
    assert info.value.model == MODEL
    assert f"[{missing[0][0]}:{missing[0][1]})" in str(info.value)


def test_banning_the_only_holder_leaves_its_layers_missing() -> None:
    cands = [cand("A", 0, 10), cand("B", 10, 20), cand("C", 20, 30)]
    with pytest.raises(NoRouteError) as info:
        plan(cands, banned={"B"})
    assert info.value.missing == [(10, 20)]
    assert "(1 holder(s) banned here, lost and not answering, or left out of this request" in str(
        info.value
    )
    # Only the avoided holders of missing layers count (A2 still serves A's).
    with pytest.raises(NoRouteError) as info:
        plan([*cands, cand("A2", 0, 10), cand("B2", 10, 20)], banned={"A", "B", "B2"})
    assert info.value.missing == [(10, 20)]
    assert "(2 holder(s) banned" in str(info.value)
    with pytest.raises(NoRouteError) as info:  # nobody holds them: no one to name
        plan([cand("A", 0, 10), cand("C", 20, 30)])
    assert "are not served" in str(info.value) and "banned" not in str(info.value)


# --- re-planning ------------------------------------------------------------------------

RTT_FLAT = {p: 5 for p in "ABCDE"}
RING = [cand("A", 0, 10, 1.0), cand("B", 10, 20, 1.0), cand("C", 20, 30, 1.0)]
RTT = {"A": 5, "B": 5, "C": 5, "D": 5, "E": 5, "F": 5, "G": 5}


def test_replan_uses_the_standby_and_keeps_the_other_stages() -> None:
    cands = [*RING, cand("D", 10, 20, 2.0)]
    route = plan(cands, RTT)
    assert shape(route) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    assert route.stages[1].standby == "D"
    # a cheap whole-model holder shows up: still only the broken range moves
    later = [*cands, cand("G", 0, L, 0.1)]
    new = replan(route, "B", later, rtt_ms=RTT)
    assert shape(new) == [("A", 0, 10), ("D", 10, 20), ("C", 20, 30)]
    assert new.stages[1].est_s == pytest.approx(0.025)
    assert new.stages[0].standby == "G" and new.stages[1].standby == "G"
    assert "B" not in new.peers


def test_replan_without_an_eligible_standby_splits_the_range() -> None:
    cands = [*RING, cand("D", 10, 20, 2.0), cand("E", 10, 15, 2.5), cand("F", 15, 20, 2.5)]
    route = plan(cands, RTT)
    assert route.stages[1].standby == "D"
    new = replan(route, "B", cands, rtt_ms=RTT, banned={"D"})
    assert shape(new) == [("A", 0, 10), ("E", 10, 15), ("F", 15, 20), ("C", 20, 30)]


def test_replan_skips_a_standby_short_of_kv_tokens() -> None:
    cands = [*RING, cand("D", 10, 20, 2.0, kv=50), cand("E", 10, 20, 3.0)]
    route = plan(cands, RTT)
    assert route.stages[1].standby == "D"
    new = replan(route, "B", cands, rtt_ms=RTT, need_tokens=60)
    assert shape(new)[1] == ("E", 10, 20)


def test_replan_with_no_holder_for_the_range_raises() -> None:
    route = plan(RING, RTT)
    assert route.stages[1].standby is None
    with pytest.raises(NoRouteError) as info:
        replan(route, "B", RING, rtt_ms=RTT)
    assert info.value.missing == [(10, 20)]


def test_replan_plans_again_when_only_route_peers_hold_the_range() -> None:
    # A holds [0,20) but B was cheaper for [10,20); with B gone only A is left
    cands = [cand("A", 0, 20, 1.0), cand("B", 10, 20, 0.1), cand("C", 20, 30, 1.0)]
    route = plan(cands, RTT)
    assert shape(route) == [("A", 0, 10), ("B", 10, 20), ("C", 20, 30)]
    new = replan(route, "B", cands, rtt_ms=RTT)
    assert shape(new) == [("A", 0, 20), ("C", 20, 30)]


def test_replan_of_a_peer_outside_the_route_keeps_the_stages() -> None:
    cands = [*RING, cand("D", 10, 20, 2.0), cand("E", 10, 20, 3.0)]
    route = plan(cands, RTT)
    assert route.stages[1].standby == "D"
    new = replan(route, "D", cands, rtt_ms=RTT)
    assert shape(new) == shape(route)
    assert new.stages[1].standby == "E"  # the failed standby is replaced


# --- determinism and optimality ---------------------------------------------------------


def random_swarm(rng: random.Random, peers: int) -> tuple[list[Candidate], dict[str, float]]:
    cands, rtt = [], {}
    for i in range(peers):
        a = rng.randrange(0, L)
        b = rng.randrange(a + 1, L + 1)
        peer = ME if i == 0 else f"P{i:02d}"
        cands.append(cand(peer, a, b, rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])))
        rtt[peer] = rng.choice([1, 5, 10, 20])
    cands.append(cand("BASE", 0, L, 4.0))  # always coverable
    rtt["BASE"] = 30
    return cands, rtt


def test_shuffled_input_gives_the_same_route() -> None:
    rng = random.Random(7)
    for _ in range(20):
        cands, rtt = random_swarm(rng, 10)
        expected = plan(cands, rtt)
        for _ in range(5):
            shuffled = cands[:]
            rng.shuffle(shuffled)
            assert plan(shuffled, rtt) == expected


def brute_force_ns(cands: list[Candidate], rtt: dict[str, float]) -> int:
    """The cheapest route without repeated peers, by trying every one (small inputs)."""
    bounds = sorted({0, L} | {x for c in cands for x in (c.start, c.end)})
    cost = {
        c.peer_id: (
            round(c.layer_cost_s * 1e9),
            0 if c.peer_id == ME else round(rtt[c.peer_id] * 1e6),
        )
        for c in cands
    }
    best = None

    def walk(at: int, used: frozenset[str], total: int) -> None:
        nonlocal best
        if at == L:
            best = total if best is None else min(best, total)
            return
        for c in cands:
            if c.peer_id in used or not c.start <= at < c.end:
                continue
            layer_ns, link_ns = cost[c.peer_id]
            for b in bounds:
                if at < b <= c.end:
                    walk(b, used | {c.peer_id}, total + (b - at) * layer_ns + link_ns)

    walk(0, frozenset(), 0)
    assert best is not None
    return best


def check_valid(route: Route) -> None:
    at = 0
    for stage in route.stages:
        assert stage.start == at and stage.end > stage.start
        at = stage.end
    assert at == L
    assert len(set(route.peers)) == len(route.peers)


def test_route_is_the_cheapest_without_repeated_peers() -> None:
    rng = random.Random(11)
    exact = RouteConfig(hop_penalty_s=0.0)
    for _ in range(40):
        cands, rtt = random_swarm(rng, 6)
        route = plan(cands, rtt, config=exact)
        check_valid(route)
        assert round(route.est_s * 1e9) == brute_force_ns(cands, rtt)


def test_a_narrow_search_still_finds_a_valid_route() -> None:
    rng = random.Random(3)
    narrow = RouteConfig(hop_penalty_s=0.0, max_states_per_boundary=1)
    for _ in range(40):
        cands, rtt = random_swarm(rng, 6)
        cands = [c for c in cands if c.peer_id != "BASE"]
        cands += [cand("BASE0", 0, 16, 4.0), cand("BASE1", 14, L, 4.0)]
        rtt |= {"BASE0": 30, "BASE1": 30}
        route = plan(cands, rtt, config=narrow)
        check_valid(route)
        assert round(route.est_s * 1e9) >= brute_force_ns(cands, rtt)


def test_a_replay_keeps_prompt_chunks_and_regroups_the_reply() -> None:
    from swarmd.pipeline.distributed import replay_steps

    steps = [[1, 2, 3], [4, 5], [6], [7], [8], [9], [10]]
    assert replay_steps(steps, 2) == [
        ([1, 2, 3], False),
        ([4, 5], False),
        ([6, 7], True),
        ([8, 9], True),
        ([10], False),
    ]
    assert replay_steps([[1]], 4) == [([1], False)]
    assert replay_steps([], 4) == []
