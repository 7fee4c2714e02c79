"""Circuit relay v2 between real libp2p hosts on 127.0.0.1: a host that takes no inbound
connection is reached through a relay, its frames end to end, and the relay's fixes hold."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from swarmd.errors import DialError
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.punch import DCUTR_PROTOCOL
from swarmd.net.relay import Relay, RelaySettings
from swarmd.net.remote_addr import remote_ips
from tests.trio_run import run_trio

ECHO = "/swarmd-test/echo/1"
DEADLINE_S = 60.0


@dataclass
class Peer:
    host: P2PHost
    relay: Relay
    refused: set[str]


@asynccontextmanager
async def peer(listen: bool = True, serve: bool = False) -> AsyncIterator[Peer]:
    refused: set[str] = set()
    async with open_host(Identity.generate(), 0, listen=listen) as host:

        async def echo(stream: FrameStream) -> None:
            while True:
                await stream.send(await stream.recv(math.inf))

        host.set_handler(ECHO, echo, gated=False)
        relay = Relay(host.libp2p, RelaySettings(serve=serve), lambda p: p not in refused)
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.run)
            host.circuit_dialer = relay.dial
            yield Peer(host, relay, refused)
            nursery.cancel_scope.cancel()


async def reserve_on(node: Peer, relay: Peer) -> str:
    """`node` connects to the relay, waits until identify says it relays, and reserves;
    the circuit address it would announce."""
    await node.host.connect(relay.host.addrs[0])
    assert await poll(lambda: relay.host.peer_id in node.relay.candidates(), 10.0)
    assert await node.relay.reserve(relay.host.peer_id, 10.0)
    node.host.relayed = [f"{relay.host.addrs[0]}/p2p-circuit"]
    return node.host.announced[0]


async def poll(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate()` until it is true or the deadline passes (identify answers in ms)."""
    deadline = trio.current_time() + timeout_s
    while trio.current_time() < deadline:
        if predicate():
            return True
        await trio.sleep(0.02)
    return predicate()


async def echo_round(a: P2PHost, b_peer_id: str, payload: bytes) -> None:
    stream = await a.open_stream(b_peer_id, ECHO)
    try:
        await stream.send({"p": payload})
        assert (await stream.recv(10))["p"] == payload
    finally:
        await stream.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    run_trio(test, DEADLINE_S)


def test_a_host_without_inbound_connections_is_reached_through_a_relay() -> None:
    async def test() -> None:
        async with peer(serve=True) as r, peer(listen=False) as b, peer() as a:
            assert b.host.addrs == [] and b.host.announced == []  # nothing to dial, yet
            circuit = await reserve_on(b, r)
            assert (
                circuit == (f"{r.host.addrs[0]}/p2p-circuit/p2p/{b.host.peer_id}")
                and b.relay.reserved_on == r.host.peer_id
            )
            assert await a.host.connect(circuit) == b.host.peer_id
            for size in (10, 1000, 300_000):  # frames of every size, both ways
                await echo_round(a.host, b.host.peer_id, bytes(range(256)) * (size // 256 + 1))
            # The circuit is no TCP address: it never lands among a peer's dialable ones.
            assert all("/p2p-circuit" not in x for x in a.host.peer_addrs(b.host.peer_id))
            # Its far end is the relay, not the peer: no IP of the peer (for an address ban,
            # or a dial-back) comes from it, and it is no direct link.
            assert remote_ips(a.host, b.host.peer_id) == []
            assert remote_ips(b.host, a.host.peer_id) == []
            assert remote_ips(a.host, r.host.peer_id) == ["127.0.0.1"]
            assert not a.relay.direct_to(b.host.peer_id) and a.relay.direct_to(r.host.peer_id)

    run(test)


def test_without_a_relay_service_no_slot_and_no_circuit() -> None:
    async def test() -> None:
        async with peer(serve=False) as r, peer(listen=False) as b, peer() as a:
            await b.host.connect(r.host.addrs[0])
            await trio.sleep(0.5)  # identify has answered: r does not say it relays
            assert b.relay.candidates() == []
            assert not await b.relay.reserve(r.host.peer_id, 5.0)
            circuit = f"{r.host.addrs[0]}/p2p-circuit/p2p/{b.host.peer_id}"
            with pytest.raises(DialError):
                await a.host.connect(circuit, timeout_s=5.0)

    run(test)


def test_a_relay_refuses_a_peer_its_gate_refuses() -> None:
    async def test() -> None:
        async with peer(serve=True) as r, peer(listen=False) as b:
            r.refused.add(b.host.peer_id)  # banned, or not proven in a private swarm
            await b.host.connect(r.host.addrs[0])
            assert await poll(lambda: r.host.peer_id in b.relay.candidates(), 10.0)
            assert not await b.relay.reserve(r.host.peer_id, 5.0)
            assert b.relay.reserved_on is None

    run(test)


def test_one_circuit_ending_leaves_the_other_circuits_to_that_peer() -> None:
    """The library's relay closed the latest circuit to a peer whenever any circuit to
    it ended: the first dialer leaving cut the second one off."""

    async def test() -> None:
        async with peer(serve=True) as r, peer(listen=False) as b:
            circuit = await reserve_on(b, r)
            async with peer() as a2:
                async with peer() as a1:
                    await a1.host.connect(circuit)
                    await a2.host.connect(circuit)
                    await echo_round(a1.host, b.host.peer_id, b"one")
                    await echo_round(a2.host, b.host.peer_id, b"two")
                    await a1.host.disconnect(b.host.peer_id)
                await trio.sleep(0.5)  # the relay has seen a1's circuit end
                await echo_round(a2.host, b.host.peer_id, b"still there")

    run(test)


def test_a_hole_punch_session_passes_the_gate() -> None:
    """The DCUtR stream is gated as the relay's are: a refused peer's never reaches the
    hole punch (which counts every session it answers)."""

    async def session(a: Peer, b: Peer) -> None:
        stream = await a.host.libp2p.new_stream(ID.from_base58(b.host.peer_id), [DCUTR_PROTOCOL])
        try:
            with trio.fail_after(10), pytest.raises(StreamEOF):  # ended, nothing to punch
                await stream.read(10)
        finally:
            await stream.reset()

    async def test() -> None:
        async with peer() as a, peer() as b:
            await a.host.connect(b.host.addrs[0])
            asker = ID.from_base58(a.host.peer_id)
            await session(a, b)
            assert len(b.relay.punch._answered[asker]) == 1  # answered
            b.refused.add(a.host.peer_id)
            await session(a, b)
            assert len(b.relay.punch._answered[asker]) == 1  # refused at the gate

    run(test)
