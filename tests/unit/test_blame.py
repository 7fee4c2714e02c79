"""Blame that cannot be forged: the coordinator bans only on its own evidence.

A stage's `fail` report naming another peer used to get that peer banned, so one hostile
stage could ban every honest one in turn. Now the report is checked (a ping of the peer
it names): a silent peer is this node's own evidence; one that answers is only avoided
for this request, and the teller is charged - three false reports in ten minutes and
the teller is the one banned. A refusal of what the request asked is a 4xx, no failover.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from swarmd.dht.records import NodeRecord
from swarmd.errors import (
    InvalidRequestError,
    KVRoomError,
    NoRouteError,
    PeerError,
    QueueFullError,
    RouteBusyError,
    StageFailedError,
    SwarmError,
    UnconfirmedReportError,
)
from swarmd.model.sampling import SamplingParams
from swarmd.pipeline import ring as ring_module
from swarmd.pipeline import wire
from swarmd.pipeline.admission import SessionSlot, SessionSlots
from swarmd.pipeline.distributed import ChainSettings, DistributedChain, plan
from swarmd.pipeline.report import FalseReports
from swarmd.pipeline.ring import Ring, RingTimeouts
from swarmd.pipeline.room import RoomQueue
from swarmd.pipeline.route import Route, plan_route
from tests.threads import in_both_threads
from tests.unit.test_route import record as route_record

L = 30
MODEL = "m"
COORD = "12D3KooWCOORDxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
LIAR = "12D3KooWLIARxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
FIRST2 = "12D3KooWFIRST2xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
HONEST = "12D3KooWHONESTxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
HONEST2 = "12D3KooWHONEST2xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
LAST = "12D3KooWLASTxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
SETTINGS = ChainSettings(MODEL, L, 100, 16, max_failovers=4, timeouts=RingTimeouts())


def record(peer: str, start: int, end: int, tps: float) -> NodeRecord:
    return route_record(peer, start, end, tps, model_id=MODEL)


# The liar and HONEST are the preferred holders of their ranges; each has a standby.
RECORDS = [
    record(LIAR, 0, 10, 1000.0),
    record(FIRST2, 0, 10, 10.0),
    record(HONEST, 10, 20, 1000.0),
    record(HONEST2, 10, 20, 10.0),
    record(LAST, 20, 30, 1000.0),
]


class FakeSwarm:
    """The node as a chain sees it, with bans and losses recorded (the lost peers in
    `answers` answer a ping); trio calls run inline."""

    peer_id = COORD
    stage_service: Any = None

    def __init__(self, records: list[NodeRecord] = RECORDS) -> None:
        self.records = records
        self.bans: list[tuple[str, str]] = []
        self.losses: list[tuple[str, str]] = []
        self.answers: set[str] = set()
        self.asked: list[set[str]] = []
        self.measurements: dict[str, float] = {}
        self.rtt: dict[str, float] = {}

    async def holders(self, model_id: str) -> list[NodeRecord]:
        return self.records

    def rtt_ms(self) -> dict[str, float]:
        return dict(self.rtt)

    def layer_ms(self) -> dict[str, float]:
        return dict(self.measurements)

    def measured(self, peer_id: str, layer_ms: float) -> None:
        self.measurements[peer_id] = layer_ms

    def banned(self) -> set[str]:
        return {peer for peer, _ in self.bans}

    def sitting_out(self) -> set[str]:
        return {peer for peer, _ in self.losses}

    async def answering(self, peer_ids: set[str]) -> set[str]:
        self.asked.append(set(peer_ids))
        back = peer_ids & self.answers
        self.losses = [(p, why) for p, why in self.losses if p not in back]
        return back

    def listen_addrs(self) -> list[str]:
        return []

    async def ban(self, peer_id: str, reason: str) -> None:
        self.bans.append((peer_id, reason))

    async def lose(self, peer_id: str, reason: str) -> None:
        self.losses.append((peer_id, reason))

    async def in_trio(self, fn: Any, *args: Any) -> Any:
        return await fn(*args)


def first_route(swarm: FakeSwarm) -> Route:
    return plan_route(MODEL, L, COORD, RECORDS, banned=swarm.banned(), need_tokens=100)


# --- the chain: what it does with each kind of failure -----------------------------------


def test_a_liar_naming_an_honest_peer_never_gets_it_banned_and_is_banned_itself() -> None:
    swarm = FakeSwarm()
    ledger = FalseReports()

    async def requests() -> None:
        for n in range(1, 4):  # three requests, each told the same lie once
            route = first_route(swarm)
            assert route.peers == (LIAR, HONEST, LAST)
            chain = DistributedChain(swarm, SETTINGS, route, RECORDS, 100, ledger)
            lie = UnconfirmedReportError("stage HONEST lost", HONEST, "lost", LIAR, True)
            await chain._fail_over(lie)
            assert HONEST not in swarm.banned()
            if n < 3:
                assert swarm.bans == []
                # This request goes on around the named peer; the next may use it again.
                assert chain.route.peers == (LIAR, HONEST2, LAST)
        assert [peer for peer, _ in swarm.bans] == [LIAR]
        assert "proved false" in swarm.bans[0][1]
        # The third request went on without the liar (and with HONEST back in).
        assert chain.route.peers == (FIRST2, HONEST, LAST)
        assert first_route(swarm).peers == (FIRST2, HONEST, LAST)

    asyncio.run(requests())


def test_lies_about_peers_off_the_route_are_charged_too() -> None:
    swarm = FakeSwarm()
    ledger = FalseReports()

    async def requests() -> None:
        for _ in range(3):
            chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100, ledger)
            await chain._fail_over(UnconfirmedReportError("x lost", None, "lost", LIAR, True))
        assert swarm.banned() == {LIAR}

    asyncio.run(requests())


def test_a_neighbour_that_hangs_up_cannot_get_a_serving_teller_banned() -> None:
    """A hostile stage closes its stream to HONEST and still answers pings: HONEST's true
    report ("LIAR closed our stream") reads as disproved. Once HONEST has served a step
    (around the hang-up, through FIRST2) it is never charged for such reports."""
    swarm = FakeSwarm()
    ledger = FalseReports()

    async def requests() -> None:
        for n in range(1, 7):
            chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100, ledger)
            told = UnconfirmedReportError("LIAR closed the stream", LIAR, "lost", HONEST, True)
            await chain._fail_over(told)
            assert chain.route.peers == (FIRST2, HONEST, LAST), n  # around the hang-up
            assert swarm.bans == [], n
            ledger.served(chain.route.peers)  # the replayed ring carries a step
        assert ledger.count(HONEST) == 1  # the first request only, before it had served

    asyncio.run(requests())


def test_a_teller_that_serves_is_still_charged_for_naming_a_peer_off_the_route() -> None:
    swarm = FakeSwarm()
    ledger = FalseReports()
    ledger.served([LIAR])

    async def requests() -> None:
        for _ in range(3):
            chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100, ledger)
            await chain._fail_over(UnconfirmedReportError("x lost", None, "lost", LIAR, True))
        assert swarm.banned() == {LIAR}  # a lie whatever its teller's record

    asyncio.run(requests())


def test_a_bad_frame_report_a_ping_cannot_disprove_never_charges_its_teller() -> None:
    """The named peer may feed garbage to its neighbour alone and answer this node: the
    neighbour (which bans it itself) must not be the one banned for telling."""
    swarm = FakeSwarm()
    ledger = FalseReports()

    async def requests() -> None:
        for _ in range(5):
            chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100, ledger)
            told = UnconfirmedReportError("bad frame", HONEST, "bad", LAST, False)
            await chain._fail_over(told)
            assert chain.route.peers == (LIAR, HONEST2, LAST)  # routed around, this request
        assert swarm.bans == []

    asyncio.run(requests())


def test_when_only_the_named_peer_holds_its_range_the_request_avoids_the_teller() -> None:
    records = [r for r in RECORDS if r.peer_id != HONEST2]  # HONEST alone holds 10:20
    swarm = FakeSwarm(records)

    async def request() -> None:
        route = plan_route(MODEL, L, COORD, records, need_tokens=100)
        chain = DistributedChain(swarm, SETTINGS, route, records, 100)
        await chain._fail_over(UnconfirmedReportError("HONEST lost", HONEST, "lost", LIAR, True))
        assert chain.route.peers == (FIRST2, HONEST, LAST)
        assert swarm.bans == []

    asyncio.run(request())


def test_own_evidence_still_bans_at_once() -> None:
    swarm = FakeSwarm()

    async def request() -> None:
        chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100)
        await chain._fail_over(StageFailedError("bad frame from stage", HONEST, "bad"))
        assert swarm.banned() == {HONEST}
        assert chain.route.peers == (LIAR, HONEST2, LAST)

    asyncio.run(request())


def test_a_declined_stage_is_left_out_of_this_request_only() -> None:
    swarm = FakeSwarm()

    async def request() -> None:
        chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100)
        await chain._fail_over(StageFailedError("no KV room", HONEST, "declined"))
        assert swarm.bans == []
        assert chain.route.peers == (LIAR, HONEST2, LAST)

    asyncio.run(request())


# --- the ring: which error a report becomes ----------------------------------------------


def make_ring(route: tuple[str, ...], me: str = COORD) -> Ring:
    hops, at = [], 0
    for peer in route:
        hops.append(wire.RouteHop(peer, at, at + L // len(route)))
        at += L // len(route)
    request = wire.OpenRequest(
        "r.1", 0, tuple(hops), {}, me, MODEL, 64, SamplingParams(), history=()
    )
    service = SimpleNamespace(peer_id=me, host=None)
    return Ring(service, request, RingTimeouts(), 100)  # type: ignore[arg-type]


def fake_pings(monkeypatch: pytest.MonkeyPatch, silent: frozenset[str]) -> list[str]:
    """The ring's pings answered by every peer but the `silent` ones; the peers pinged."""
    pinged: list[str] = []

    async def fake_ping(host: object, peer_id: str, timeout_s: float, rounds: int) -> None:
        pinged.append(peer_id)
        if peer_id in silent:
            raise PeerError("no answer", peer_id)

    monkeypatch.setattr(ring_module, "call_ping", fake_ping)
    return pinged


def judge(
    monkeypatch: pytest.MonkeyPatch,
    ring: Ring,
    frame: dict[str, Any],
    source: str,
    silent: frozenset[str] = frozenset(),
) -> tuple[SwarmError, list[str]]:
    pinged = fake_pings(monkeypatch, silent)

    async def run() -> SwarmError:
        return await ring._judge(wire.parse_fail(frame), source)

    return trio.run(run), pinged


def test_a_report_naming_a_peer_that_answers_is_unconfirmed_and_charged_to_its_teller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    error, pinged = judge(monkeypatch, ring, wire.fail_frame(HONEST, "lost", "lost"), "up")
    assert isinstance(error, UnconfirmedReportError)
    assert (error.peer_id, error.reporter, pinged) == (HONEST, LIAR, [HONEST])
    # On the return stream, the teller is the last stage.
    assert error.disproved  # a peer said to be lost answered
    error, _ = judge(monkeypatch, ring, wire.fail_frame(HONEST, "bad", "bad"), "ret")
    assert isinstance(error, UnconfirmedReportError) and error.reporter == LAST
    assert not error.disproved  # a ping says nothing of the frames it sent


def test_past_this_nodes_own_stage_the_teller_is_its_neighbour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((COORD, LIAR, HONEST))  # stage 0 is this node (a LoopLink)
    error, _ = judge(monkeypatch, ring, wire.fail_frame(HONEST, "lost", "lost"), "up")
    assert isinstance(error, UnconfirmedReportError) and error.reporter == LIAR


def test_a_report_naming_a_peer_that_does_not_answer_is_own_evidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    frame = wire.fail_frame(HONEST, "lost", "lost")
    error, _ = judge(monkeypatch, ring, frame, "up", frozenset({HONEST}))
    assert type(error) is StageFailedError
    assert (error.peer_id, error.kind) == (HONEST, "lost")


def test_a_stage_that_names_itself_is_believed(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    error, pinged = judge(monkeypatch, ring, wire.fail_frame(LIAR, "step failed", "lost"), "up")
    assert type(error) is StageFailedError and error.peer_id == LIAR and pinged == []


def test_a_report_naming_this_node_or_a_stranger_blames_nobody_on_the_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    error, _ = judge(monkeypatch, ring, wire.fail_frame(COORD, "lost", "lost"), "up")
    assert type(error) is StageFailedError and error.peer_id is None
    stranger = "12D3KooWSTRANGERxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
    error, pinged = judge(monkeypatch, ring, wire.fail_frame(stranger, "lost", "lost"), "up")
    assert isinstance(error, UnconfirmedReportError)  # a lie about a peer not even there
    assert (error.peer_id, error.reporter, pinged) == (None, LIAR, [])


def test_a_refusal_of_the_request_is_its_4xx_not_a_failover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    frame = wire.fail_frame(HONEST, "top_k -1", "refused", 400, "top_k")
    error, pinged = judge(monkeypatch, ring, frame, "up")
    assert isinstance(error, InvalidRequestError) and not isinstance(error, StageFailedError)
    assert (error.status, error.param, pinged) == (400, "top_k", [])
    frame = wire.fail_frame(HONEST, "too long", "refused", 413, "max_tokens")
    error, _ = judge(monkeypatch, ring, frame, "up")
    assert isinstance(error, KVRoomError) and error.status == 413


def test_a_declined_report_only_leaves_its_stage_out(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    error, pinged = judge(monkeypatch, ring, wire.fail_frame(HONEST, "busy", "declined"), "up")
    assert isinstance(error, StageFailedError) and not isinstance(error, UnconfirmedReportError)
    assert (error.peer_id, error.kind, pinged) == (HONEST, "declined", [])


def test_a_request_the_older_stages_cannot_read_is_planned_around_them() -> None:
    """A stage of an older swarmd would refuse the open frame of a request with logprobs
    or a grammar (and ban this node): such a request, and its failover, use only stages
    that read it; a plain request still uses the old ones."""
    old = [replace(r, version="0.1.0" if r.peer_id in (LIAR, HONEST) else "0.2.0") for r in RECORDS]
    swarm = FakeSwarm(old)
    plain = SamplingParams(temperature=0.0)
    asks = SamplingParams(temperature=0.0, top_logprobs=2)

    async def run() -> None:
        route, _ = await plan(swarm, SETTINGS, 100, plain)
        assert route.peers == (LIAR, HONEST, LAST)  # the faster holders
        route, records = await plan(swarm, SETTINGS, 100, asks)
        assert route.peers == (FIRST2, HONEST2, LAST)
        chain = DistributedChain(swarm, SETTINGS, route, records, 100, FalseReports())
        chain._sampling = asks
        # HONEST2 declines: the only other holder of 10:20 is old, so there is no route
        # (a plain request's failover would take HONEST).
        with pytest.raises(NoRouteError):
            await chain._fail_over(StageFailedError("busy", HONEST2, "declined"))
        chain = DistributedChain(swarm, SETTINGS, route, records, 100, FalseReports())
        chain._sampling = plain
        await chain._fail_over(StageFailedError("busy", HONEST2, "declined"))
        assert chain.route.peers == (FIRST2, HONEST, LAST)  # only the decliner replaced
        swarm.records = [r for r in old if r.peer_id != HONEST2]
        with pytest.raises(NoRouteError):  # only an old stage holds 10:20
            await plan(swarm, SETTINGS, 100, asks)

    asyncio.run(run())


def test_decode_steps_measure_each_remote_stage_and_a_plan_follows_them() -> None:
    """A decode step's stage times become each remote stage's ms per layer; a report
    longer than the whole round trip this node timed is cut to it; the next plan takes
    the measured speed over a record's claim."""
    swarm = FakeSwarm()
    route = first_route(swarm)
    assert route.peers == (LIAR, HONEST, LAST)
    chain = DistributedChain(swarm, SETTINGS, route, RECORDS, 100, FalseReports())
    reply = wire.TokenReply(0, 7, (300.0, 5.0, 9_999.0), 0)
    chain._measure(reply, round_trip_s=0.4)
    assert swarm.measurements == {LIAR: 30.0, HONEST: 0.5, LAST: 40.0}  # ms per layer

    async def replan() -> None:
        # 30 ms a layer: LIAR's 1,000 tok/s claim loses to FIRST2's 10 tok/s (10 ms).
        again, _ = await plan(swarm, SETTINGS, 100, SamplingParams())
        assert again.peers[0] == FIRST2

    asyncio.run(replan())


@pytest.mark.parametrize("silent", [frozenset(), frozenset({HONEST})], ids=["slow", "silent"])
def test_a_stalled_step_blames_a_stage_that_stops_answering_pings_at_once(
    monkeypatch: pytest.MonkeyPatch, silent: frozenset[str]
) -> None:
    """No answer for `stall_s`: the stages are pinged. A silent one (a black-holed link)
    is to blame then, not at the step timeout; while all answer, the step is only slow
    and the wait goes on until the step timeout, which blames nobody."""
    ring = make_ring((LIAR, HONEST, LAST))
    ring._timeouts = RingTimeouts(step_s=60.0, stall_s=4.0)
    ring._sent_at.append(0.0)
    pinged = fake_pings(monkeypatch, silent)

    async def run() -> tuple[StageFailedError, float]:
        started = trio.current_time()
        with pytest.raises(StageFailedError) as info:
            await ring._receive(want=True)
        return info.value, trio.current_time() - started

    error, waited = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    if silent:
        assert (error.peer_id, error.kind, waited) == (HONEST, "lost", 4.0)
        assert pinged == [LIAR, HONEST]
    else:
        assert (error.peer_id, waited) == (None, 60.0)
        assert len(pinged) == 3 * 15  # every stage at each of the 14 stalls and at the end


def test_a_stage_that_under_reports_its_compute_is_charged_the_round_trip() -> None:
    """In a route of one remote stage, the time no report and no link explains is that
    stage's: claiming 0 ms gains it nothing."""
    records = [record(COORD, 0, 20, 1000.0), record(LIAR, 20, 30, 1e6)]
    swarm = FakeSwarm(records)
    route = plan_route(MODEL, L, COORD, records, need_tokens=100)
    assert route.peers == (COORD, LIAR) and route.stages[0].local
    chain = DistributedChain(swarm, SETTINGS, route, records, 100, FalseReports())
    chain._measure(wire.TokenReply(0, 7, (8.0, 0.0), 0), round_trip_s=0.058)
    assert swarm.measurements == {LIAR: pytest.approx(5.0)}  # (58 - 8) ms over 10 layers
    swarm.rtt = {LIAR: 20.0}  # the link explains part of it (RTTs are taken per ring)
    chain = DistributedChain(swarm, SETTINGS, route, records, 100, FalseReports())
    chain._measure(wire.TokenReply(1, 7, (8.0, 0.0), 0), round_trip_s=0.058)
    assert swarm.measurements == {LIAR: pytest.approx(3.0)}


# --- a stage without room: the request waits for one, nobody is blamed -------------------


def test_when_every_holder_of_a_range_declines_the_request_waits_and_tries_them_again() -> None:
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)  # only a session's end wakes it here

    async def request() -> None:
        deadline = time.monotonic() + 60.0
        chain = DistributedChain(
            swarm, SETTINGS, first_route(swarm), RECORDS, 100, room=room, room_deadline=deadline
        )
        await chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        assert chain.route.peers == (LIAR, HONEST2, LAST)  # the other holder first
        failing_over = asyncio.ensure_future(
            chain._fail_over(StageFailedError("no KV room", HONEST2, "busy"))
        )
        assert await _until(lambda: room.waiting == 1)
        assert not failing_over.done()  # both holders of 10:20 are busy: it waits
        room.freed()  # a session of this node ended
        await asyncio.wait_for(failing_over, 5.0)
        # Both decliners are eligible again: the best holder of 10:20 is tried first.
        assert chain.route.peers == (LIAR, HONEST, LAST)
        assert (chain.failovers, chain.room_waits, swarm.bans) == (0, 1, [])
        assert room.waiting == 1  # in line until a ring opens, or the request ends
        await chain.close()
        assert room.waiting == 0

    asyncio.run(request())


def test_a_request_whose_other_holder_is_lost_waits_for_the_busy_one() -> None:
    """HONEST had no room, so HONEST2 took the range; when HONEST2 is lost, HONEST is
    asked again (busy is no failure) and, still full, the request waits its turn for it:
    it used to end with "layers [10:20) are not served" (found by a stress run)."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    async def request() -> None:
        chain = _waiting_chain(swarm, room, time.monotonic() + 60.0)
        await chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        assert chain.route.peers == (LIAR, HONEST2, LAST)
        await chain._fail_over(StageFailedError("connection lost", HONEST2, "lost"))
        assert chain.route.peers == (LIAR, HONEST, LAST)  # the busy holder, asked again
        assert (chain.failovers, swarm.sitting_out(), swarm.bans) == (1, {HONEST2}, [])
        waits = asyncio.ensure_future(
            chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        )
        assert await _until(lambda: room.waiting == 1)
        assert not waits.done()  # still full: it waits, it does not fail
        room.freed()
        await asyncio.wait_for(waits, 5.0)
        assert chain.route.peers == (LIAR, HONEST, LAST)
        assert (chain.failovers, chain.room_waits) == (1, 1)
        await chain.close()

    asyncio.run(request())


def test_a_full_queue_turns_away_a_new_request_but_never_a_started_one() -> None:
    """The node's `max_queued_requests` holds for requests waiting for busy stages too:
    one that has not started gets QueueFullError (503) instead of a place in line; one
    mid-reply (its stage lost, the others busy) always waits."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    def full() -> None:
        raise QueueFullError(256)

    async def request() -> None:
        deadline = time.monotonic() + 60.0
        chain = _waiting_chain(swarm, room, deadline, room_wait_s=60.0, refuse_if_full=full)
        await chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        with pytest.raises(QueueFullError):
            await chain._fail_over(StageFailedError("no KV room", HONEST2, "busy"))
        assert room.waiting == 0
        chain._steps = [[1, 2, 3]]  # started: it waits in line
        waits = asyncio.ensure_future(
            chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        )
        assert await _until(lambda: room.waiting == 1)
        room.freed()
        await asyncio.wait_for(waits, 5.0)
        await chain.close()

    asyncio.run(request())


def test_a_lost_stage_whose_range_nobody_else_holds_is_no_route() -> None:
    """Without a busy holder to wait for, a lost range is missing: the request ends."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    async def request() -> None:
        chain = _waiting_chain(swarm, room, time.monotonic() + 60.0)
        await chain._fail_over(StageFailedError("connection lost", HONEST, "lost"))
        with pytest.raises(NoRouteError) as caught:
            await chain._fail_over(StageFailedError("connection lost", HONEST2, "lost"))
        assert caught.value.missing == [(10, 20)] and room.waiting == 0

    asyncio.run(request())


def test_a_lost_stage_sits_out_routes_while_another_holder_serves_and_is_not_banned() -> None:
    """A stage that went silent or whose link broke did nothing wrong: routes leave it
    out while its standby serves, but it is not banned (it may use this node meanwhile)
    and nobody asks it whether it is back."""
    swarm = FakeSwarm()

    async def requests() -> None:
        chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100)
        await chain._fail_over(StageFailedError("no token in 4 s", HONEST, "lost"))
        assert chain.route.peers == (LIAR, HONEST2, LAST)
        assert (swarm.bans, swarm.sitting_out()) == ([], {HONEST})
        swarm.answers = {HONEST}  # it would answer, but the standby does without it
        route, _ = await plan(swarm, SETTINGS, 100, SamplingParams())
        assert route.peers == (LIAR, HONEST2, LAST) and swarm.asked == []

    asyncio.run(requests())


@pytest.mark.parametrize("answers", [True, False])
def test_a_range_only_a_lost_holder_has_is_routed_through_it_once_it_answers(
    answers: bool,
) -> None:
    """A home network that dropped for a minute must not cost its layers a longer
    outage: with no route without the lost holder, a new request asks it (a ping), and
    one that answers is back; one that does not leaves the layers missing, named."""
    records = [r for r in RECORDS if r.peer_id != HONEST2]  # HONEST alone holds 10:20
    swarm = FakeSwarm(records)
    swarm.losses = [(HONEST, "stage failed (lost): no token in 4 s")]
    swarm.answers = {HONEST} if answers else set()

    async def request() -> None:
        if answers:
            route, _ = await plan(swarm, SETTINGS, 100, SamplingParams())
            assert route.peers == (LIAR, HONEST, LAST)
            assert swarm.sitting_out() == set()  # back for the requests after it too
        else:
            with pytest.raises(NoRouteError) as caught:
                await plan(swarm, SETTINGS, 100, SamplingParams())
            assert caught.value.missing == [(10, 20)]
            assert "1 holder(s) banned here, lost and not answering" in str(caught.value)
        assert swarm.asked == [{HONEST}]  # only the lost holder, once
        assert swarm.bans == []

    asyncio.run(request())


@pytest.mark.parametrize("answers", [True, False])
def test_a_failover_whose_only_standby_was_lost_earlier_asks_it_back(answers: bool) -> None:
    """Mid-reply, the stage is lost and the only other holder of its range sits out
    after an earlier loss: it is asked (not the stage just lost), and, answering, takes
    the range; silent, the reply ends with the range missing."""
    swarm = FakeSwarm()
    swarm.losses = [(HONEST2, "stage failed (lost): an hour ago")]
    swarm.answers = {HONEST, HONEST2} if answers else set()

    async def request() -> None:
        chain = DistributedChain(swarm, SETTINGS, first_route(swarm), RECORDS, 100)
        assert chain.route.peers == (LIAR, HONEST, LAST)
        lost = StageFailedError("no token in 4 s", HONEST, "lost")
        if answers:
            await chain._fail_over(lost)
            assert chain.route.peers == (LIAR, HONEST2, LAST)
        else:
            with pytest.raises(NoRouteError):
                await chain._fail_over(lost)
        assert swarm.asked == [{HONEST2}] and swarm.bans == []

    asyncio.run(request())


def test_a_banned_holder_is_never_asked_back() -> None:
    """Only the lost sit out; a peer banned for what it sent stays out, route or not."""
    records = [r for r in RECORDS if r.peer_id != HONEST2]
    swarm = FakeSwarm(records)
    swarm.bans = [(HONEST, "bad frame")]
    swarm.losses = [(HONEST, "stage failed (lost)")]
    swarm.answers = {HONEST}

    async def request() -> None:
        with pytest.raises(NoRouteError):
            await plan(swarm, SETTINGS, 100, SamplingParams())
        assert swarm.asked == []

    asyncio.run(request())


def _waiting_chain(
    swarm: FakeSwarm,
    room: RoomQueue,
    deadline: float,
    slot: SessionSlot | None = None,
    **more: Any,
) -> DistributedChain:
    return DistributedChain(
        swarm,
        SETTINGS,
        first_route(swarm),
        RECORDS,
        100,
        room=room,
        room_deadline=deadline,
        slot=slot,
        **more,
    )


async def _one_slot_taken() -> tuple[SessionSlots, SessionSlot]:
    slots = SessionSlots(1, 60.0)
    slot = slots.slot(lambda: False)
    await slot.take(time.monotonic() + 5.0)
    return slots, slot


def test_a_request_waiting_for_a_busy_stage_lends_its_session_slot_meanwhile() -> None:
    """Requests waiting for one model's full stages must not keep the coordinator's
    slots from requests that could run (another model's, another route's)."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    async def request() -> None:
        slots, slot = await _one_slot_taken()
        chain = _waiting_chain(swarm, room, time.monotonic() + 60.0, slot)
        await chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        assert slot.held  # another holder had room: no wait, the slot stays
        waits = asyncio.ensure_future(
            chain._fail_over(StageFailedError("no KV room", HONEST2, "busy"))
        )
        assert await _until(lambda: room.waiting == 1)
        assert not slot.held and slots.free == 1  # lent while it waits ...
        other = slots.slot(lambda: False)
        await asyncio.wait_for(other.take(time.monotonic() + 1.0), 1.0)  # ... another runs
        room.freed()
        await asyncio.sleep(0.05)
        assert not waits.done()  # woken, it waits for the slot to come back
        other.give()
        await asyncio.wait_for(waits, 5.0)
        assert slot.held and slots.in_flight == 1
        await chain.close()
        slot.give()
        assert slots.in_flight == 0 and slots.free == 1

    asyncio.run(request())


def test_a_new_request_queues_behind_those_already_waiting_for_its_models_stages() -> None:
    """Else it would take the room a session's end frees before the requests that waited
    for it, and they could wait until their deadlines."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    async def request() -> None:
        other_model = room.join(("another model", ((0, 4),)))
        ahead = room.join((MODEL, ((10, 20),)))
        _, slot = await _one_slot_taken()
        chain = _waiting_chain(swarm, room, time.monotonic() + 60.0, slot)
        queued = asyncio.ensure_future(chain._queue_behind_others())
        assert await _until(lambda: room.waiting == 3)
        await asyncio.sleep(0.05)
        assert not queued.done() and not slot.held  # behind `ahead`, its slot lent
        room.leave(ahead)  # admitted: the next in line tries
        await asyncio.wait_for(queued, 5.0)
        assert slot.held and chain.room_waits == 1
        await chain.close()
        assert room.waiting == 1  # the other model's line is another line
        room.leave(other_model)
        # With nobody waiting for its model, a request tries at once.
        alone = _waiting_chain(swarm, room, time.monotonic() + 60.0)
        await asyncio.wait_for(alone._queue_behind_others(), 1.0)
        assert alone.room_waits == 0 and room.waiting == 0
        slot.give()

    asyncio.run(request())


def test_a_request_past_its_deadline_does_not_wait_for_a_slot_first() -> None:
    """Its slot lent to another request, a waiter whose stages stay busy gets its 503
    at its deadline, without waiting to take the slot back (found by review)."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=30.0)

    async def request() -> None:
        slots, slot = await _one_slot_taken()
        started = time.monotonic()
        chain = _waiting_chain(swarm, room, started + 0.3, slot)
        await chain._fail_over(StageFailedError("no KV room", HONEST, "busy"))
        waits = asyncio.ensure_future(
            chain._fail_over(StageFailedError("no KV room", HONEST2, "busy"))
        )
        assert await _until(lambda: room.waiting == 1)
        other = slots.slot(lambda: False)
        await asyncio.wait_for(other.take(time.monotonic() + 1.0), 1.0)  # another takes it
        with pytest.raises(RouteBusyError):
            await asyncio.wait_for(waits, 5.0)
        assert time.monotonic() - started < 1.5 and not slot.held
        other.give()

    asyncio.run(request())


def test_a_request_whose_stages_stay_busy_past_its_deadline_gets_a_busy_error() -> None:
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=0.05)

    async def request() -> None:
        deadline = time.monotonic() + 0.3
        chain = DistributedChain(
            swarm, SETTINGS, first_route(swarm), RECORDS, 100, room=room, room_deadline=deadline
        )
        with pytest.raises(RouteBusyError) as caught:
            for _ in range(100):  # every try turned down by whichever holder of 10:20 it asks
                peer = chain.route.stages[1].peer_id
                await chain._fail_over(StageFailedError("no KV room", peer, "busy"))
        assert caught.value.missing == [(10, 20)]
        assert "layers [10:20)" in str(caught.value) and "100 tokens" in str(caught.value)
        assert chain.room_waits >= 2  # it polled while it waited
        assert (chain.failovers, swarm.bans, room.waiting) == (0, [], 0)

    asyncio.run(request())


def test_a_plan_goes_through_busy_holders_but_never_ones_too_small_for_the_request() -> None:
    """Records whose free tokens say "full" lag behind: the route ignores them (the
    stages decide, and the chain waits for room); a holder whose whole budget is below
    what the request needs would never take it, so there is no route through it."""
    busy = [replace(r, free_kv_tokens=0) if r.layer_start == 10 else r for r in RECORDS]
    small = [replace(r, kv_budget_tokens=50) if r.layer_start == 10 else r for r in busy]
    plain = SamplingParams(temperature=0.0)

    async def run() -> None:
        route, _ = await plan(FakeSwarm(busy), SETTINGS, 100, plain)
        assert route.peers == (LIAR, HONEST, LAST)
        with pytest.raises(KVRoomError):  # no route could ever hold it: 413
            await plan(FakeSwarm(small), SETTINGS, 100, plain)
        mixed = [replace(r, kv_budget_tokens=50) if r.peer_id == HONEST else r for r in busy]
        route, _ = await plan(FakeSwarm(mixed), SETTINGS, 100, plain)
        assert route.peers == (LIAR, HONEST2, LAST)  # the one that could take it

    asyncio.run(run())


def test_a_busy_stage_that_names_nobody_waits_each_try_and_fails_at_the_deadline() -> None:
    """This node's own stage busy (the report names no route peer): no other holder to
    try, so every try waits, and past the deadline the request fails at once: a stage
    that keeps saying "busy" can never make it loop."""
    swarm = FakeSwarm()
    room = RoomQueue(poll_s=0.02)

    async def request() -> None:
        chain = _waiting_chain(swarm, room, time.monotonic() + 0.2)
        started = time.monotonic()
        with pytest.raises(RouteBusyError) as caught:
            for _ in range(1000):
                await chain._fail_over(StageFailedError("no KV room", None, "busy"))
        assert 0.15 < time.monotonic() - started < 5.0
        assert chain.room_waits < 50  # one try per poll, not a hot loop
        assert caught.value.missing == [] and "A stage of model 'm'" in str(caught.value)
        assert (chain.failovers, swarm.bans, room.waiting) == (0, [], 0)

    asyncio.run(request())


def test_a_stage_declining_for_another_reason_is_left_out_even_with_a_line_to_wait_in() -> None:
    """ "Not here" (a model or layers it does not serve, a next hop it cannot reach) is no
    lack of room: waiting would not help, so the stage is left out and, with no other
    holder, the request fails at once, as before."""
    swarm = FakeSwarm([r for r in RECORDS if r.peer_id != HONEST2])
    room = RoomQueue()

    async def request() -> None:
        route = plan_route(MODEL, L, COORD, swarm.records, need_tokens=100)
        chain = DistributedChain(
            swarm,
            SETTINGS,
            route,
            swarm.records,
            100,
            room=room,
            room_deadline=time.monotonic() + 60.0,
        )
        with pytest.raises(NoRouteError):
            await chain._fail_over(StageFailedError("does not serve 'm'", HONEST, "declined"))
        assert (swarm.bans, room.waiting) == ([], 0)

    asyncio.run(request())


def test_only_a_route_stage_or_this_node_saying_busy_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ring = make_ring((LIAR, HONEST, LAST))
    for peer, kind, named in [
        (HONEST, "busy", HONEST),  # a stage of the route has no room
        (COORD, "busy", None),  # this node's own stage has none
        (FIRST2, "declined", None),  # "busy" about a peer off the route: not waited for
    ]:
        error, pinged = judge(monkeypatch, ring, wire.busy_frame(peer, "no KV room"), "up")
        assert isinstance(error, StageFailedError)
        assert (error.kind, error.peer_id, pinged) == (kind, named, [])
    error, _ = judge(monkeypatch, ring, wire.fail_frame(HONEST, "no such model", "declined"), "up")
    assert (error.kind, error.peer_id) == ("declined", HONEST)


def test_a_lost_stages_range_goes_to_a_standby_whose_record_shows_no_room() -> None:
    """Records lag: a standby announcing no room may have some by the time the ring
    opens, and if not it says "busy" and the request waits. So a failover goes through
    it rather than ending the reply with "not served" (without a line to wait in, the
    old rule stands)."""
    full = [replace(r, free_kv_tokens=0) if r.peer_id == HONEST2 else r for r in RECORDS]

    async def request(room: RoomQueue | None) -> Route:
        swarm = FakeSwarm(full)
        route = plan_route(MODEL, L, COORD, full, need_tokens=100)
        chain = DistributedChain(
            swarm, SETTINGS, route, full, 100, room=room, room_deadline=time.monotonic() + 60
        )
        await chain._fail_over(StageFailedError("stage lost", HONEST, "lost"))
        assert (swarm.sitting_out(), swarm.bans) == ({HONEST}, [])
        return chain.route

    assert asyncio.run(request(RoomQueue())).peers == (LIAR, HONEST2, LAST)
    with pytest.raises(NoRouteError):
        asyncio.run(request(None))


async def _until(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


def test_a_peer_served_in_the_trio_thread_stays_vouched_for_on_the_loop() -> None:
    # A ring's callback marks its peers served in the trio thread while the chain asks,
    # on the loop, whether a teller served: the answer never flickers to "no".
    ledger = FalseReports()
    ledger.served(["teller"])
    answers: set[bool] = set()

    def serve_again(_: int) -> None:
        ledger.served(["teller", "other"])

    assert in_both_threads(serve_again, lambda: answers.add(ledger.vouched("teller"))) == []
    assert answers == {True}
