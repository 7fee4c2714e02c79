"""The KV budget: reservations in FIFO order, 413 past the whole budget, nothing leaked by a
wait that times out or is cancelled; other peers' part of it, capped per peer and in all;
the route's capacity from the holders' records."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest

from swarmd.dht.records import NodeRecord
from swarmd.errors import ClientDisconnectedError, KVRoomError, OverloadedError
from swarmd.net.bridge import TrioBridge
from swarmd.pipeline.admission import (
    KVBudget,
    PeerBudget,
    PeerLimits,
    SessionSlots,
    unless_gone,
)
from swarmd.pipeline.distributed import route_capacity
from tests.threads import switching_often


async def test_reservations_wait_in_fifo_order_and_are_given_back() -> None:
    budget = KVBudget(100)
    await budget.reserve(60, 1)
    order: list[str] = []

    async def wants(name: str, tokens: int) -> None:
        await budget.reserve(tokens, 5)
        order.append(name)

    big = asyncio.create_task(wants("big", 70))
    await asyncio.sleep(0)
    small = asyncio.create_task(wants("small", 10))  # fits now, but waits behind "big"
    await asyncio.sleep(0.01)
    assert order == [] and budget.waiting == 2
    assert not budget.try_reserve(10)  # a remote open does not jump the queue either
    budget.release(60)
    await asyncio.gather(big, small)
    assert order == ["big", "small"] and budget.reserved == 80 and budget.free == 20
    budget.release(70)
    budget.release(10)
    assert budget.reserved == 0


async def test_more_than_the_whole_budget_is_refused_at_once_naming_both_numbers() -> None:
    budget = KVBudget(4096)
    with pytest.raises(KVRoomError, match=r"needs 4,312 tokens.*holds 4,096") as info:
        await budget.reserve(4312, 30)
    assert info.value.status == 413 and info.value.code == "context_length_exceeded"
    assert budget.reserved == 0 and budget.waiting == 0


async def test_a_wait_that_times_out_or_is_cancelled_leaves_nothing_reserved() -> None:
    budget = KVBudget(100)
    await budget.reserve(90, 1)
    with pytest.raises(OverloadedError, match="stayed too full"):
        await budget.reserve(50, 0.05)
    cancelled = asyncio.create_task(budget.reserve(50, 5))
    behind = asyncio.create_task(budget.reserve(10, 5))  # fits once the one ahead is gone
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await behind
    assert budget.reserved == 100 and budget.waiting == 0


def test_one_peer_is_capped_in_sessions_and_tokens_and_others_still_get_room() -> None:
    node = KVBudget(1000)
    peers = PeerBudget(node, PeerLimits(kv_share=0.8, peer_kv_share=0.5, max_peer_sessions=3))
    assert (peers.total, peers.per_peer) == (800, 500)
    assert [peers.try_reserve("h", 100) for _ in range(3)] == [None, None, None]
    why = peers.try_reserve("h", 100)
    assert why is not None and "3 sessions per peer" in why
    assert peers.held_by("h") == (3, 300)
    why = peers.try_reserve("h2", 600)  # over one peer's share of the tokens
    assert why is not None and "600 tokens" in why and "one peer" in why
    assert peers.try_reserve("g", 400) is None  # another peer: room left
    why = peers.try_reserve("f", 200)  # all peers together: 700 + 200 > 800
    assert why is not None and "free for remote sessions" in why
    assert node.reserved == peers.reserved == 700  # the node's budget bounds memory
    assert node.free >= node.total - peers.total  # ... and keeps its own part
    for _ in range(3):
        peers.release("h", 100)
    peers.release("g", 400)
    peers.release("nobody", 50)  # a stray release changes nothing
    assert node.reserved == peers.reserved == 0 and peers.held_by("h") == (0, 0)


def test_a_session_larger_than_a_peer_may_ever_hold_is_told_apart_from_no_room_now() -> None:
    # "Never" is a decline the coordinator routes around; "not now" (busy) it may wait out.
    peers = PeerBudget(KVBudget(1000), PeerLimits(kv_share=0.8, peer_kv_share=0.5))
    assert peers.never_fits(500) is None and peers.never_fits(1) is None
    why = peers.never_fits(501)
    assert why is not None and "501 tokens never fits" in why and "500 for one peer" in why
    assert peers.try_reserve("p", 400) is None
    assert peers.never_fits(400) is None  # taken now is not never: it frees again
    whole = PeerBudget(KVBudget(1000), PeerLimits(kv_share=0.3, peer_kv_share=0.5))
    assert whole.never_fits(301) is not None and whole.never_fits(300) is None
    for closed in (PeerLimits(max_sessions=0), PeerLimits(max_peer_sessions=0)):
        why = PeerBudget(KVBudget(1000), closed).never_fits(1)
        assert why is not None and "no other peer's sessions" in why


def test_remote_sessions_are_counted_in_all_and_never_jump_the_nodes_queue() -> None:
    node = KVBudget(10_000)
    peers = PeerBudget(node, PeerLimits(max_sessions=4, max_peer_sessions=4))
    for name in "abcd":
        assert peers.try_reserve(name, 1) is None
    why = peers.try_reserve("e", 1)
    assert why is not None and "all 4 remote session slots" in why and peers.free == 0
    peers.release("a", 1)
    assert peers.free > 0


async def test_a_waiting_api_request_goes_before_any_remote_session() -> None:
    node = KVBudget(100)
    peers = PeerBudget(node, PeerLimits(kv_share=1.0, peer_kv_share=1.0))
    await node.reserve(90, 1)
    waiting = asyncio.create_task(node.reserve(50, 5))
    await asyncio.sleep(0.01)
    assert peers.try_reserve("p", 5) is not None  # it would fit, but the API waits
    node.release(90)
    await waiting
    assert peers.try_reserve("p", 5) is None


def test_by_default_one_peer_may_hold_32_sessions() -> None:
    # e.g. 32 sessions of 4,096 tokens on a node whose KV budget holds 262,144 tokens
    peers = PeerBudget(KVBudget(262_144), PeerLimits())
    assert all(peers.try_reserve("coordinator", 4096) is None for _ in range(32))
    assert peers.try_reserve("coordinator", 1) is not None
    assert peers.try_reserve("another", 4096) is None


def record(peer: str, start: int, end: int, budget: int) -> NodeRecord:
    return NodeRecord(
        peer_id=peer,
        model_id="m",
        model_hash="",
        layer_start=start,
        layer_end=end,
        num_layers=30,
        dtype="bfloat16",
        weights="int4",
        free_kv_tokens=budget,
        kv_budget_tokens=budget,
        throughput_tps=0.0,
        state="ready",
        addrs=(),
        api_url="",
        version="0",
        expires_at=0.0,
    )


def test_the_route_capacity_is_the_best_holder_of_the_tightest_layer() -> None:
    records = [record("a", 0, 15, 9000), record("b", 0, 10, 20000), record("c", 15, 30, 5000)]
    assert route_capacity(records, 30, set()) == 5000
    records.append(record("d", 10, 30, 7000))
    assert route_capacity(records, 30, set()) == 7000
    assert route_capacity(records, 30, {"d"}) == 5000
    assert route_capacity(records[:2], 30, set()) is None  # layers 15..30 unheld


async def test_a_request_whose_client_left_gives_up_its_wait_for_kv_room() -> None:
    node = KVBudget(100)
    await node.reserve(90, 1)
    gone = False
    leaving = asyncio.create_task(unless_gone(node.reserve(50, 60), lambda: gone))
    behind = asyncio.create_task(node.reserve(40, 60))
    await asyncio.sleep(0.05)
    assert node.waiting == 2
    gone = True
    with pytest.raises(ClientDisconnectedError):
        await asyncio.wait_for(leaving, 5.0)
    assert node.waiting == 1  # its place went ...
    node.release(90)
    await asyncio.wait_for(behind, 5.0)  # ... and the one behind it got the room
    assert node.reserved == 40
    assert await unless_gone(asyncio.sleep(0, "done"), lambda: True) == "done"


async def test_a_session_slot_is_taken_in_turn_given_back_once_and_left_when_the_client_goes() -> (
    None
):
    slots = SessionSlots(1, 0.2)
    slot = slots.slot(lambda: False)
    await slot.take(time.monotonic() + 1.0)
    other = slots.slot(lambda: False)
    with pytest.raises(OverloadedError, match=r"All 1 session slots stayed busy for 0\.2 s"):
        await other.take(time.monotonic() + 0.2)
    assert not other.held and slots.in_flight == 1
    taking = asyncio.create_task(other.take(time.monotonic() + 60.0))
    await asyncio.sleep(0.05)
    slot.give()
    slot.give()  # once only
    await asyncio.wait_for(taking, 1.0)
    assert other.held and not slot.held and slots.in_flight == 1
    gone = False
    leaving = slots.slot(lambda: gone)
    waits = asyncio.create_task(leaving.take(time.monotonic() + 60.0))
    await asyncio.sleep(0.05)
    gone = True
    with pytest.raises(ClientDisconnectedError):  # its client left while it waited
        await asyncio.wait_for(waits, 5.0)
    other.give()
    assert slots.free == 1 and slots.in_flight == 0  # nothing leaked by the wait


@pytest.mark.parametrize("ticks", [0, 1, 2, 3, 4])
async def test_a_slot_granted_as_its_request_is_cancelled_is_given_back(ticks: int) -> None:
    """The slot frees, the waiter is granted it, and its request is cancelled a few loop
    ticks later (another choice of the request failed): whichever wins, `give` after
    the cancel leaves the slot free (found by review: it was lost for good)."""
    slots = SessionSlots(1, 60.0)
    holder = slots.slot(lambda: False)
    await holder.take(time.monotonic() + 1.0)
    waiter = slots.slot(lambda: False)
    taking = asyncio.create_task(waiter.take(time.monotonic() + 60.0))
    await asyncio.sleep(0.05)
    holder.give()
    for _ in range(ticks):
        await asyncio.sleep(0)
    taking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await taking
    waiter.give()  # what the request's cleanup does
    assert slots.free == 1
    await asyncio.wait_for(slots.slot(lambda: False).take(time.monotonic() + 1.0), 1.0)


async def test_unless_gone_returns_only_once_its_wait_has_ended_even_when_cancelled_twice() -> None:
    ended = asyncio.Event()

    async def slow_to_cancel() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.1)  # gives back what it took, which takes a moment
            ended.set()

    outer = asyncio.create_task(unless_gone(slow_to_cancel(), lambda: False))
    await asyncio.sleep(0.05)
    outer.cancel()
    await asyncio.sleep(0.02)
    outer.cancel()  # again, while it waits for the inner wait to end
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended.is_set()


async def test_a_release_in_the_trio_thread_lets_a_waiting_api_request_in_at_once() -> None:
    # The stage service (trio, its own thread) gives back a remote session's room while
    # a request of this node's API waits for it on the loop.
    budget = KVBudget(100)
    peers = PeerBudget(budget, PeerLimits(kv_share=1.0, peer_kv_share=1.0))
    async with TrioBridge() as bridge:

        async def open_remote() -> str | None:
            return peers.try_reserve("peer-a", 80)

        async def close_remote() -> None:
            peers.release("peer-a", 80)

        assert await bridge.run(open_remote) is None
        waiting = asyncio.create_task(budget.reserve(60, timeout_s=10.0))
        await asyncio.sleep(0.01)
        assert budget.waiting == 1 and not waiting.done()
        started = time.monotonic()
        # A background task: nothing but the release itself wakes this loop.
        bridge.start_soon(close_remote)
        await asyncio.wait_for(waiting, 5.0)
        assert time.monotonic() - started < 1.0
        assert budget.reserved == 60 and budget.waiting == 0 and peers.sessions == 0


def test_the_budgets_stay_whole_under_both_threads_at_once() -> None:
    # Remote sessions come and go in another thread (the stage service's) while API
    # requests wait for room, some giving up as they are let in: every token taken is
    # given back, once.
    budget = KVBudget(1_000)
    peers = PeerBudget(budget, PeerLimits(kv_share=0.5, peer_kv_share=0.5))
    stop = threading.Event()
    errors: list[BaseException] = []

    def remote_sessions() -> None:
        pick = random.Random(1)
        held: list[int] = []
        try:
            while not stop.is_set():
                if held and pick.random() < 0.5:
                    peers.release("peer-a", held.pop())
                elif peers.try_reserve("peer-a", tokens := pick.randint(1, 50)) is None:
                    held.append(tokens)
        except BaseException as exc:
            errors.append(exc)
        for tokens in held:
            peers.release("peer-a", tokens)

    async def one(pick: random.Random) -> None:
        tokens = pick.randint(1, 300)
        with contextlib.suppress(OverloadedError):
            await budget.reserve(tokens, timeout_s=pick.choice([0.001, 0.01, 0.2]))
            await asyncio.sleep(pick.random() * 0.002)
            budget.release(tokens)

    async def api_requests() -> None:
        pick = random.Random(2)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(pick) for _ in range(50)))

    with switching_often():
        other = threading.Thread(target=remote_sessions)
        other.start()
        try:
            asyncio.run(api_requests())
        finally:
            stop.set()
            other.join()
    assert errors == []
    assert budget.reserved == 0 and budget.waiting == 0
    assert peers.reserved == 0 and peers.sessions == 0
