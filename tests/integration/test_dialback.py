"""Peers dial a node back to tell it whether it is reachable (real libp2p hosts on
127.0.0.1): a listening host is "public"; one whose advertised address drops or refuses
connections is "private"; nobody is made to dial another machine, another peer's key does
not pass for the caller's, and a caller that asks too often is refused, not banned."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID

from swarmd.errors import RemoteError
from swarmd.net.dialback import DialBackService, call_dial_back, direct_tcp, judge
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.rpc import RpcService
from tests.trio_run import run_trio

DEADLINE_S = 60.0
DIAL_S = 1.0  # the answering side's dial timeout here (5 s in a node)


@dataclass
class Peer:
    host: P2PHost
    service: DialBackService


@asynccontextmanager
async def peer(announce: tuple[str, ...] = (), cooldown_s: float = 60.0) -> AsyncIterator[Peer]:
    async with open_host(Identity.generate(), 0, announce=announce) as host:
        service = DialBackService(host, timeout_s=DIAL_S, cooldown_s=cooldown_s)
        service.register(RpcService(host))
        yield Peer(host, service)


def silent_listener() -> socket.socket:
    """A port that takes TCP connections and never says a word: what a NAT that drops
    the packets, or a dead forward, looks like to a dialer once the handshake is done."""
    return socket.create_server(("127.0.0.1", 0), backlog=16)


def run(test: Callable[[], Awaitable[None]]) -> None:
    run_trio(test, DEADLINE_S)


def test_a_listening_host_is_reached_on_a_fresh_connection() -> None:
    async def test() -> None:
        async with peer() as a, peer() as b:
            await b.host.connect(a.host.addrs[0])
            # A wildcard listener has an address per interface: more than one question
            # may name; the first few are asked about.
            others = [f"/ip4/127.0.0.{i}/tcp/9/p2p/{b.host.peer_id}" for i in range(2, 7)]
            many = b.host.direct + others
            verdict = await judge(b.host, [a.host.peer_id], many)
            assert verdict.reachability == "public" and verdict.asked == 1
            assert verdict.reached == (b.host.addrs[0].split("/p2p/")[0],)
            # The check's connection was its own and is gone; the peers' stays.
            assert a.host.connected_peers() == [b.host.peer_id]
            assert b.host.connected_peers() == [a.host.peer_id]

    run(test)


@pytest.mark.parametrize("kind", ["silent", "closed"])
def test_a_host_whose_advertised_address_is_dead_is_private(kind: str) -> None:
    async def test() -> None:
        listener = silent_listener()
        port = listener.getsockname()[1]
        if kind == "closed":
            listener.close()  # nothing listens there: refused at once
        try:
            async with peer() as a, peer(announce=(f"/ip4/127.0.0.1/tcp/{port}",)) as b:
                await b.host.connect(a.host.addrs[0])
                assert b.host.direct == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{b.host.peer_id}"]
                started = trio.current_time()
                verdict = await judge(b.host, [a.host.peer_id], b.host.direct)
                assert verdict.reachability == "private" and verdict.reached == ()
                assert trio.current_time() - started < DIAL_S + 2.0
        finally:
            listener.close()

    run(test)


def test_another_peers_key_at_the_address_does_not_count() -> None:
    """B names C's address as its own: the dial reaches C, whose key is not B's."""

    async def test() -> None:
        async with peer() as a, peer() as b, peer() as c:
            await b.host.connect(a.host.addrs[0])
            answer = await call_dial_back(b.host, a.host.peer_id, [c.host.addrs[0]])
            assert answer == {"reached": [], "tried": 1}

    run(test)


def test_only_the_callers_own_ip_is_dialed() -> None:
    async def test() -> None:
        async with peer() as a, peer() as b:
            await b.host.connect(a.host.addrs[0])
            addrs = [
                "/ip4/10.1.2.3/tcp/81",  # another machine: never dialed, its port is
                "/dns4/example.com/tcp/82",  # names, circuits, other transports: ignored
                f"{a.host.addrs[0]}/p2p-circuit",
                "/ip4/127.0.0.1/udp/83/quic-v1",
            ]
            targets = a.service._targets(b.host.peer_id, addrs)
            assert targets == ["/ip4/127.0.0.1/tcp/81"]
            assert [direct_tcp(x) for x in addrs] == [("10.1.2.3", 81), None, None, None]

    run(test)


def test_too_many_questions_or_bad_ones_are_refused_and_nothing_else() -> None:
    async def test() -> None:
        async with peer() as a, peer() as b:
            await b.host.connect(a.host.addrs[0])
            for bad in ([], ["/ip4/127.0.0.1/tcp/1"] * 5, ["x" * 300], "not a list"):
                with pytest.raises(RemoteError) as refused:
                    await call_dial_back(b.host, a.host.peer_id, bad)  # type: ignore[arg-type]
                assert refused.value.remote_type == "InvalidRequestError"
            await call_dial_back(b.host, a.host.peer_id, b.host.direct)
            with pytest.raises(RemoteError) as again:
                await call_dial_back(b.host, a.host.peer_id, b.host.direct)
            assert again.value.remote_type == "OverloadedError"
            assert a.host.connected_peers() == [b.host.peer_id]  # refused, still a peer

    run(test)


def test_a_peer_that_cannot_answer_leaves_the_verdict_unknown() -> None:
    """An older node has no "dial_back" method: its refusal says nothing either way."""

    async def test() -> None:
        async with open_host(Identity.generate(), 0) as old, peer() as b:
            RpcService(old)
            await b.host.connect(old.addrs[0])
            verdict = await judge(b.host, [old.peer_id], b.host.direct)
            assert verdict.reachability == "unknown" and "dial_back" in verdict.detail

    run(test)


@pytest.mark.parametrize("late_s", [0.0, 0.3])
def test_a_check_leaves_the_connection_it_was_asked_on_open(
    late_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dial-back arrives as an inbound connection from the asked peer. With one
    connection a peer allowed, libp2p trimmed the older one once it was past its grace
    period: every session on it died, and the stages were banned (a swarm ten minutes
    old, at its first re-check). The asked peers are protected while asked, and until
    the dial-back's connection has come and gone, even when this side registers it only
    after the answer (`late_s`: a busy loop)."""
    add_conn = Swarm.add_conn

    async def late_add_conn(self: Swarm, *args: Any, **kwargs: Any) -> Any:
        await trio.sleep(late_s)
        return await add_conn(self, *args, **kwargs)

    async def test() -> None:
        async with peer() as a, peer() as b:
            await b.host.connect(a.host.addrs[0])
            monkeypatch.setattr(Swarm, "add_conn", late_add_conn)
            networks = [h.libp2p.get_network() for h in (a.host, b.host)]
            before = networks[1].connections[ID.from_base58(a.host.peer_id)][0]
            for network in networks:  # as if connected for long: past the grace period
                for conns in network.connections.values():
                    for conn in conns:
                        conn._created_at = time.time() - 3600
            for _ in range(2):  # and again, once the peer's cooldown allows
                verdict = await judge(b.host, [a.host.peer_id], b.host.direct)
                assert verdict.reachability == "public"
                a.service._last.clear()
            await trio.sleep(late_s + 0.5)  # a connection registered late would be here now
            after = networks[1].connections[ID.from_base58(a.host.peer_id)]
            assert after == [before] and not before.is_closed
            # the RPC path still works over it
            verdict = await judge(b.host, [a.host.peer_id], b.host.direct)
            assert verdict.reachability == "public"

    run(test)
