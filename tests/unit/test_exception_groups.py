"""Trio exception groups do not hide who sent garbage.

A trio nursery wraps what its tasks raise in an exception group, so `except PeerError`
after one never matched: garbage from the previous hop mid-session went unbanned, and
the next stage, seeing its stream cut, blamed the honest stage in between. Here a stage
session's upstream link raises a group holding a `MalformedFrameError` (as a stream that
reads in a nursery of its own does) and the sender is the one banned and reported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

from swarmd.errors import (
    FrameTooLargeError,
    MalformedFrameError,
    PeerError,
    StageFailedError,
    StreamClosedError,
)
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams
from swarmd.net.loop_errors import first_of
from swarmd.pipeline import wire
from swarmd.pipeline.admission import KVBudget
from swarmd.pipeline.ring import Ring, RingTimeouts
from swarmd.pipeline.stage_service import HeldStage, StageService, StageTimeouts

UP = "12D3KooWUPSTREAMxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
ME = "12D3KooWMIDDLExxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
DOWN = "12D3KooWDOWNxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"


class FakeHost:
    peer_id = ME

    def set_handler(self, protocol: str, handler: object) -> None:
        pass

    def connected_peers(self) -> list[str]:
        return [UP, DOWN]


class GarbageLink:
    """An upstream whose read fails inside a nursery of its own: a group of `error`."""

    peer_id = UP

    def __init__(self, error: PeerError) -> None:
        self.error = error

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                raise self.error

            nursery.start_soon(read)
        raise AssertionError("unreachable: the nursery raised")

    async def send(self, obj: dict[str, Any], timeout_s: float | None = None) -> None:
        pass

    async def close(self) -> None:
        pass


class DownLink:
    """The honest next stage: records what it is sent, sends nothing back."""

    peer_id = DOWN

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, obj: dict[str, Any], timeout_s: float | None = None) -> None:
        self.sent.append(obj)

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        await trio.sleep_forever()
        raise StreamClosedError("unreachable", DOWN)

    async def close(self) -> None:
        pass


def session(error: PeerError) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    """Run one stage session of ME (hop 1 of UP, ME, DOWN): the bans and DOWN's frames."""
    bans: list[tuple[str, str]] = []
    down = DownLink()

    async def ban(peer_id: str, why: str) -> None:
        bans.append((peer_id, why))

    async def run_job(job: object, timeout_s: float) -> object:
        raise AssertionError("no step reaches the worker")

    async def main() -> None:
        limits = wire.StageLimits(ME, "m", LayerRange(10, 20), 30, 8, 100, 512)
        stage = HeldStage.of(limits, torch.float32, run_job, KVBudget(1024))
        service = StageService(
            FakeHost(),  # type: ignore[arg-type]
            [stage],
            ban,
            StageTimeouts(open_s=1.0, idle_s=5.0, step_s=1.0),
        )

        async def dial(peer_id: str, addrs: tuple[str, ...] = ()) -> DownLink:
            assert peer_id == DOWN
            return down

        service.dial = dial  # type: ignore[method-assign]
        route = (wire.RouteHop(UP, 0, 10), wire.RouteHop(ME, 10, 20), wire.RouteHop(DOWN, 20, 30))
        req = wire.OpenRequest("s.1", 1, route, {}, UP, "m", 64, SamplingParams(), ())
        with trio.fail_after(5):
            await service._run_session(stage, GarbageLink(error), req)  # type: ignore[arg-type]

    trio.run(main)
    return bans, down.sent


@pytest.mark.parametrize(
    "error",
    [MalformedFrameError("not msgpack", UP), FrameTooLargeError("a 2 GiB frame", UP)],
)
def test_garbage_from_upstream_in_a_group_bans_the_sender_not_the_next_stage(
    error: PeerError,
) -> None:
    bans, sent = session(error)
    assert [peer for peer, _ in bans] == [UP]
    fails = [wire.parse_fail(f) for f in sent if f.get("t") == "fail"]
    assert [(f.peer_id, f.kind) for f in fails] == [(UP, "bad")]  # DOWN told who, not blamed


def test_first_of_finds_the_real_error_in_nested_groups() -> None:
    inner = MalformedFrameError("bad", UP)
    group = BaseExceptionGroup("outer", [ValueError("x"), ExceptionGroup("inner", [inner])])
    assert first_of(group, PeerError) is inner
    assert first_of(inner, PeerError) is inner
    assert first_of(ExceptionGroup("g", [ValueError("x")]), PeerError) is None
    assert first_of(KeyError("k"), PeerError) is None


def test_a_coordinator_link_reading_garbage_in_a_group_blames_that_link_as_bad() -> None:
    """The ring's reader: a group of a frame error on stage 0's link is stage 0's bad
    frame (banned), not a lost link that a report from behind it could pin on another."""
    route = (wire.RouteHop(UP, 0, 10), wire.RouteHop(ME, 10, 20), wire.RouteHop(DOWN, 20, 30))
    request = wire.OpenRequest("s.1", 0, route, {}, "12D3KooWCOORD", "m", 64, SamplingParams(), ())

    async def main() -> StageFailedError:
        service = type("Service", (), {"peer_id": "12D3KooWCOORD", "host": None})()
        ring = Ring(service, request, RingTimeouts(), 100)  # type: ignore[arg-type]
        await ring._read("up", GarbageLink(MalformedFrameError("not msgpack", UP)))
        event = await ring._rx.receive()
        failure = await ring._failure(event)
        assert isinstance(failure, StageFailedError)
        return failure

    failure = trio.run(main)
    assert (failure.peer_id, failure.kind) == (UP, "bad")
