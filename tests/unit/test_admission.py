"""The KV budget: reservations in FIFO order, 413 past the whole budget, nothing leaked by a
wait that times out or is cancelled; the route's capacity from the holders' records."""

from __future__ import annotations

import asyncio

import pytest

from swarmd.dht.records import NodeRecord
from swarmd.errors import KVRoomError, OverloadedError
from swarmd.pipeline.admission import KVBudget
from swarmd.pipeline.distributed import route_capacity


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
