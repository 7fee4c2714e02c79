"""A stage under a hostile coordinator: its sessions are capped per peer and in all, it
dials only the addresses a next hop's signed record lists and tells nothing of a failed
dial, it takes no history longer than the session, and it frees a session nobody steps.

Same harness as `test_stage_service`: stage services on real libp2p hosts in one trio
run, a hand-driven peer (`raw_peer`) as the hostile coordinator, and `SIGNED` standing in
for the DHT's signed records.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import trio

from swarmd.errors import PeerError
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost
from swarmd.net.identity import Identity
from swarmd.pipeline import wire
from swarmd.pipeline.admission import PeerLimits
from swarmd.pipeline.stage_service import UNREACHABLE, StageTimeouts
from tests.integration.test_stage_service import (
    FREED_WITHIN_S,
    MAX_LENGTH,
    NUM_LAYERS,
    SIGNED,
    STAGE_TIMEOUTS,
    Model,
    StageNode,
    model,
    open_request,
    poll,
    raw_peer,
    run,
    stage_nodes,
)

__all__ = ["model"]  # the fixture, shared with test_stage_service


@dataclass
class Opened:
    """An open sent by hand: its stream, and what the stage answered on it."""

    stream: FrameStream
    replies: list[dict[str, Any]] = field(default_factory=list)

    async def collect(self) -> None:
        with contextlib.suppress(PeerError):  # the stage closed it, or the test did
            while True:
                self.replies.append(await self.stream.recv(math.inf))


Send = Callable[[StageNode, wire.OpenRequest], Awaitable[Opened]]


@asynccontextmanager
async def opens(z: P2PHost) -> AsyncIterator[Send]:
    """`send(s, request)`: Z opens a stream to S with `request`; every stream it opened
    is read until it ends, and closed when the block exits."""
    opened: list[Opened] = []
    async with trio.open_nursery() as nursery:

        async def send(s: StageNode, request: wire.OpenRequest) -> Opened:
            stream = await z.open_stream(s.peer_id, wire.STAGE_PROTOCOL)
            await stream.send(wire.open_frame(request))
            opened.append(Opened(stream))
            nursery.start_soon(opened[-1].collect)
            return opened[-1]

        try:
            yield send
        finally:
            for one in opened:
                await one.stream.close()
            nursery.cancel_scope.cancel()


async def answer(
    opened: Opened, taken: Callable[[], bool] = lambda: False, timeout_s: float = 5.0
) -> wire.Fail | None:
    """The stage's failure report on an open, or None once `taken()` (it holds it)."""
    assert await poll(lambda: bool(opened.replies) or taken(), timeout_s)
    return wire.parse_fail(opened.replies[0]) if opened.replies else None


def through(s: StageNode, nxt: str, sid: str) -> wire.OpenRequest:
    """An open for S (0:2) whose next hop, `nxt`, serves 2:4; `nxt` coordinates too (and
    is reached over the connection it has: the frame names no address)."""
    route = [(s.peer_id, 0, 2), (nxt, 2, NUM_LAYERS)]
    return open_request(nxt, route, {}, sid=sid)


def freed(s: StageNode) -> bool:
    return s.runtime.session_count == 0 and s.budget.reserved == 0 and s.peers.reserved == 0


@asynccontextmanager
async def tcp_listeners(count: int) -> AsyncIterator[tuple[list[int], list[int]]]:
    """`count` TCP ports on 127.0.0.1 that accept and then say nothing; yields the ports
    and a one-item list counting the connections they accepted."""
    accepted = [0]
    listeners = [(await trio.open_tcp_listeners(0, host="127.0.0.1"))[0] for _ in range(count)]
    held: list[trio.SocketStream] = []

    async def accept(listener: trio.SocketListener) -> None:
        while True:
            held.append(await listener.accept())
            accepted[0] += 1

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept, listener)
        try:
            yield [listener.socket.getsockname()[1] for listener in listeners], accepted
        finally:
            nursery.cancel_scope.cancel()
    for stream in held:
        await stream.aclose()
    for listener in listeners:
        await listener.aclose()


def test_one_peer_opening_many_sessions_is_capped_and_the_node_keeps_its_own_room(
    model: Model,
) -> None:
    limits = PeerLimits(max_peer_sessions=2, max_sessions=3)

    async def test() -> None:
        spec = ((0, 2), STAGE_TIMEOUTS, 8 * MAX_LENGTH, limits)
        async with (
            raw_peer() as (z, _),
            raw_peer() as (w, _),
            stage_nodes(model, spec) as (s,),
            opens(z) as z_opens,
            opens(w) as w_opens,
        ):
            await z.connect(s.host.addrs[0])
            await w.connect(s.host.addrs[0])
            answers = []
            for i in range(6):
                opened = await z_opens(s, through(s, z.peer_id, f"z{i}"))
                answers.append(await answer(opened, lambda i=i: s.runtime.session_count > i))
            assert s.runtime.session_count == 2
            assert answers[:2] == [None, None]
            for fail in answers[2:]:
                assert fail is not None and (fail.peer_id, fail.kind) == (s.peer_id, "declined")
                assert "per peer" in fail.why
            assert s.peers.held_by(z.peer_id) == (2, 2 * MAX_LENGTH)
            # the node's own requests keep their part of the budget, and their slots
            own = s.budget.total - s.peers.total
            assert own > 0 and s.budget.free >= own and s.budget.try_reserve(own)
            s.budget.release(own)
            assert s.runtime.session_count < s.runtime.max_sessions
            # another peer is not starved by the first...
            opened = await w_opens(s, through(s, w.peer_id, "w0"))
            assert await answer(opened, lambda: s.peers.held_by(w.peer_id)[0] == 1) is None
            assert s.runtime.session_count == 3
            # ... and all peers together stop at their own cap
            fail = await answer(await w_opens(s, through(s, w.peer_id, "w1")))
            assert fail is not None and fail.kind == "declined" and "remote" in fail.why
            assert s.bans == []
        assert s.peers.held_by(z.peer_id) == s.peers.held_by(w.peer_id) == (0, 0)

    run(test)


@pytest.mark.parametrize("record", ["lists-another-address", "unknown"])
def test_an_open_naming_an_address_outside_the_next_hops_record_is_declined_undialed(
    model: Model, record: str
) -> None:
    y = Identity.generate()  # the next hop the frame names; its "address" is our listener

    async def test() -> None:
        async with (
            tcp_listeners(1) as ([port], accepted),
            raw_peer() as (z, _),
            stage_nodes(model, ((0, 2), STAGE_TIMEOUTS)) as (s,),
            opens(z) as send,
        ):
            if record == "lists-another-address":
                SIGNED[y.peer_id] = frozenset({f"/ip4/127.0.0.1/tcp/9/p2p/{y.peer_id}"})
            named = {y.peer_id: (f"/ip4/127.0.0.1/tcp/{port}/p2p/{y.peer_id}",)}
            route = [(s.peer_id, 0, 2), (y.peer_id, 2, NUM_LAYERS)]
            await z.connect(s.host.addrs[0])
            fail = await answer(await send(s, open_request(z.peer_id, route, named)))
            assert fail is not None
            assert (fail.peer_id, fail.kind, fail.why) == (y.peer_id, "declined", UNREACHABLE)
            assert await poll(lambda: freed(s), FREED_WITHIN_S)
            assert accepted == [0]  # the address was never dialed
            assert s.bans == []

    run(test)


def test_a_failed_dial_tells_the_coordinator_nothing_of_why(model: Model) -> None:
    y = Identity.generate()

    async def test() -> None:
        async with (
            raw_peer() as (z, _),
            stage_nodes(model, ((0, 2), STAGE_TIMEOUTS)) as (s,),
            opens(z) as send,
        ):
            closed = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = closed[0].socket.getsockname()[1]
            await closed[0].aclose()  # nothing listens there: connection refused
            addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{y.peer_id}"
            SIGNED[y.peer_id] = frozenset({addr})
            route = [(s.peer_id, 0, 2), (y.peer_id, 2, NUM_LAYERS)]
            await z.connect(s.host.addrs[0])
            fail = await answer(await send(s, open_request(z.peer_id, route, {y.peer_id: (addr,)})))
            assert fail is not None
            assert (fail.peer_id, fail.kind, fail.why) == (y.peer_id, "lost", UNREACHABLE)
            assert await poll(lambda: freed(s), FREED_WITHIN_S)

    run(test)


def test_a_history_longer_than_the_session_is_a_bad_frame_and_nothing_is_held(
    model: Model,
) -> None:
    """An honest coordinator's history (the reply so far) always fits in its max_len."""

    async def test() -> None:
        async with (
            raw_peer() as (z, _),
            stage_nodes(model, ((0, 2), STAGE_TIMEOUTS)) as (s,),
            opens(z) as send,
        ):
            long = replace(through(s, z.peer_id, "long"), max_length=8, history=tuple(range(1, 10)))
            await z.connect(s.host.addrs[0])
            await send(s, long)
            assert await poll(lambda: s.bans != [], 5.0)
            assert [peer for peer, _ in s.bans] == [z.peer_id] and "history" in s.bans[0][1]
            assert freed(s)
            # the same open with a history of max_len tokens is taken
            fits = await send(s, replace(long, sid="fits", history=tuple(range(1, 9))))
            assert await answer(fits, lambda: s.runtime.session_count == 1) is None
            await fits.stream.close()
            assert await poll(lambda: freed(s), FREED_WITHIN_S)

    run(test)


def test_an_open_nobody_steps_is_freed_soon_after_its_open_timeout(model: Model) -> None:
    """Z opens a session on S and says nothing more, its stream left open; S dialed Z as
    the next hop, and Z, there too, stays silent. S frees everything well before its
    idle timeout (30 s): a peer cannot park sessions for the idle timeout."""
    timeouts = StageTimeouts(open_s=0.5, idle_s=30.0, step_s=10.0)

    async def test() -> None:
        async with (
            raw_peer() as (z, received),
            stage_nodes(model, ((0, 2), timeouts)) as (s,),
            opens(z) as send,
        ):
            await z.connect(s.host.addrs[0])
            opened = await send(s, through(s, z.peer_id, "parked"))
            assert await poll(lambda: s.runtime.session_count == 1, 5.0)
            assert s.budget.reserved == MAX_LENGTH
            assert await poll(lambda: freed(s), 2 * timeouts.open_s + FREED_WITHIN_S)
            assert s.peers.held_by(z.peer_id) == (0, 0)
            assert await poll(lambda: len(received) == 2, 5.0)
            assert [f["t"] for f in received] == ["open", "end"]  # the next hop is told
            assert opened.replies == [] and s.bans == []

    run(test)


def test_dialing_a_silent_next_hop_gives_up_within_one_open_timeout(model: Model) -> None:
    """The next hop's record lists six addresses that accept TCP and then say nothing:
    the whole dial, every address, stays within one `open_s`."""
    y = Identity.generate()
    timeouts = StageTimeouts(open_s=1.0, idle_s=30.0, step_s=10.0)

    async def test() -> None:
        async with (
            tcp_listeners(6) as (ports, accepted),
            raw_peer() as (z, _),
            stage_nodes(model, ((0, 2), timeouts)) as (s,),
            opens(z) as send,
        ):
            addrs = tuple(f"/ip4/127.0.0.1/tcp/{p}/p2p/{y.peer_id}" for p in ports)
            SIGNED[y.peer_id] = frozenset(addrs)
            route = [(s.peer_id, 0, 2), (y.peer_id, 2, NUM_LAYERS)]
            await z.connect(s.host.addrs[0])
            started = trio.current_time()
            opened = await send(s, open_request(z.peer_id, route, {y.peer_id: addrs}))
            fail = await answer(opened, timeout_s=10.0)
            elapsed = trio.current_time() - started
            assert fail is not None and (fail.kind, fail.why) == ("lost", UNREACHABLE)
            assert accepted[0] >= 1 and elapsed < 3 * timeouts.open_s
            assert await poll(lambda: freed(s), FREED_WITHIN_S)

    run(test)
