"""The holders view: reads never walk the DHT once a model is watched; refreshes keep it
current, expired records drop out on read, idle models are forgotten."""

from __future__ import annotations

import trio
import trio.testing

from swarmd.dht.records import NodeRecord
from swarmd.dht.view import HoldersView
from swarmd.errors import SwarmError
from tests.unit.test_route import MODEL
from tests.unit.test_route import record as route_record

A, B = "12D3KooWAAAA", "12D3KooWBBBB"


def record(peer: str, start: int, end: int, expires_at: float) -> NodeRecord:
    return route_record(peer, start, end, 50.0, expires_at=expires_at)


class FakeDht:
    """Lookups answer the current `records`; each is counted, and may be held up."""

    def __init__(self, records: list[NodeRecord]) -> None:
        self.records = records
        self.calls: list[str] = []
        self.gate: trio.Event | None = None
        self.fail = False

    async def lookup(self, model_id: str) -> list[NodeRecord]:
        self.calls.append(model_id)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise SwarmError("the DHT does not answer")
        return list(self.records)


def clocks() -> tuple[list[float], HoldersView, FakeDht]:
    now = [1000.0]
    dht = FakeDht([record(A, 0, 15, 1060.0), record(B, 15, 30, 1060.0)])
    view = HoldersView(
        dht.lookup,
        refresh_s=5.0,
        forget_after_s=60.0,
        clock=lambda: now[0],
        monotonic=lambda: now[0],
    )
    return now, view, dht


def test_only_the_first_read_walks_the_dht() -> None:
    _now, view, dht = clocks()

    async def main() -> None:
        assert view.read(MODEL) is None
        first = await view.fetch(MODEL)
        assert [r.peer_id for r in first] == [A, B]
        for _ in range(5):
            assert view.read(MODEL) == first
            assert await view.fetch(MODEL) == first
        assert dht.calls == [MODEL]

    trio.run(main)


def test_concurrent_first_reads_share_one_walk() -> None:
    _now, view, dht = clocks()
    dht.gate = trio.Event()
    answers: list[int] = []

    async def main() -> None:
        async def one() -> None:
            answers.append(len(await view.fetch(MODEL)))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            dht.gate.set()

    trio.run(main)
    assert answers == [2] * 8 and dht.calls == [MODEL]


def test_expired_records_drop_out_on_read_before_any_refresh() -> None:
    now, view, _dht = clocks()

    async def main() -> None:
        await view.fetch(MODEL)
        now[0] = 1059.0
        assert len(view.read(MODEL) or []) == 2
        now[0] = 1060.0
        assert view.read(MODEL) == []  # still watched: an empty list, not None

    trio.run(main)


def test_refreshes_follow_the_swarm_and_a_failed_one_keeps_the_last_records() -> None:
    _now, view, dht = clocks()
    errors: list[str] = []

    async def main() -> None:
        await view.fetch(MODEL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.run, lambda loop, exc: errors.append(loop))
            dht.records = [record(B, 15, 30, 1060.0)]  # A withdrew
            view.refresh_soon()
            await trio.testing.wait_all_tasks_blocked()
            assert [r.peer_id for r in view.read(MODEL) or []] == [B]
            dht.fail = True
            view.refresh_soon()
            await trio.testing.wait_all_tasks_blocked()
            assert [r.peer_id for r in view.read(MODEL) or []] == [B]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert dht.calls == [MODEL] * 3 and errors == []


def test_a_model_nobody_reads_is_forgotten_unless_pinned() -> None:
    now, view, dht = clocks()
    view.pinned.add("held")

    async def main() -> None:
        await view.fetch(MODEL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.run, lambda loop, exc: None)
            now[0] += 61.0
            view.refresh_soon()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert view.read(MODEL) is None  # forgotten: the next read walks again
        assert view.read("held") is not None  # pinned: refreshed without a read

    trio.run(main)
    assert sorted(dht.calls) == sorted([MODEL, "held"])


def test_lookup_now_walks_even_when_the_view_has_the_model() -> None:
    _now, view, dht = clocks()

    async def main() -> None:
        await view.fetch(MODEL)
        dht.records = [record(A, 0, 30, 1060.0)]
        fresh = await view.lookup_now(MODEL)
        assert [(r.peer_id, r.layer_end) for r in fresh] == [(A, 30)]

    trio.run(main)
    assert dht.calls == [MODEL, MODEL]


def test_a_record_seen_on_the_dht_updates_a_watched_model_at_once() -> None:
    """A holder's renewal or withdrawal that reaches this node's DHT is in the view before
    the next refresh; an older copy (a replay) changes nothing."""
    _now, view, dht = clocks()

    async def main() -> None:
        await view.fetch(MODEL)
        c = "12D3KooWCCCC"
        view.saw(route_record(c, 0, 30, 50.0, expires_at=1060.0, seq=5))  # a newcomer
        assert [r.peer_id for r in view.read(MODEL) or []] == [A, B, c]
        view.saw(route_record(c, 0, 30, 50.0, expires_at=1060.0, seq=4))  # replayed, older
        view.saw(route_record(c, 0, 30, 50.0, expires_at=1060.0, seq=6, state="draining"))
        assert [r.peer_id for r in view.read(MODEL) or []] == [A, B]  # it withdrew
        view.saw(route_record(A, 0, 15, 50.0, expires_at=1060.0, seq=1, model_id="other"))
        assert view.read("other") is None  # not watched: nothing to keep current

    trio.run(main)
    assert dht.calls == [MODEL]
