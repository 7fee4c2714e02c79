"""The private-swarm gate against peers with the key, another key, or hostile answers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio

from swarmd.errors import PeerError
from swarmd.net.auth import SwarmKey
from swarmd.net.frames import FrameStream
from swarmd.net.gate import AUTH_PROTOCOL, SwarmGate
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.peers import PeerTable
from swarmd.net.rpc import RpcService, call_ping

OURS = SwarmKey(b"a" * 32)
THEIRS = SwarmKey(b"b" * 32)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling state owned by libp2p
            await trio.sleep(0.02)


def run(test: Callable[[], Awaitable[None]]) -> None:
    trio.run(test)


def gated(host: P2PHost, key: SwarmKey) -> tuple[SwarmGate, PeerTable]:
    peers = PeerTable()
    gate = SwarmGate(host, key, peers)
    host.admits = gate.allows
    RpcService(host)
    return gate, peers


def test_same_key_is_admitted_other_key_is_banned_and_cut_off() -> None:
    async def main() -> None:
        async with (
            open_host(Identity.generate(), 0) as a,
            open_host(Identity.generate(), 0) as friend,
            open_host(Identity.generate(), 0) as stranger,
            trio.open_nursery() as nursery,
        ):
            gate_a, peers_a = gated(a, OURS)
            gate_f, _ = gated(friend, OURS)
            gate_s, _ = gated(stranger, THEIRS)
            for gate in (gate_a, gate_f, gate_s):
                nursery.start_soon(gate.watch)
            await friend.connect(a.addrs[0])
            await stranger.connect(a.addrs[0])
            await until(lambda: gate_a.allows(friend.peer_id) and gate_f.allows(a.peer_id))
            await until(lambda: peers_a.is_banned(stranger.peer_id, time.time()))
            assert not gate_a.allows(stranger.peer_id)
            await until(lambda: stranger.peer_id not in a.connected_peers())
            assert await call_ping(friend, a.peer_id) > 0  # a proven peer is served
            nursery.cancel_scope.cancel()

    run(main)


def test_a_hostile_answer_is_refused_without_harm() -> None:
    """A short challenge used to raise ValueError inside prove() and end the trio run."""

    async def main() -> None:
        async with (
            open_host(Identity.generate(), 0) as a,
            open_host(Identity.generate(), 0) as hostile,
            open_host(Identity.generate(), 0) as friend,
            trio.open_nursery() as nursery,
        ):
            gate_a, peers_a = gated(a, OURS)
            gate_f, _ = gated(friend, OURS)
            nursery.start_soon(gate_a.watch)
            nursery.start_soon(gate_f.watch)

            async def short_challenge(stream: FrameStream) -> None:
                await stream.send({"challenge": b"x"})
                await stream.recv(5)

            hostile.set_handler(AUTH_PROTOCOL, short_challenge, gated=False)
            await hostile.connect(a.addrs[0])
            await until(lambda: peers_a.is_banned(hostile.peer_id, time.time()))
            # The hostile peer cannot reach the RPC protocol either.
            try:
                await call_ping(hostile, a.peer_id, timeout_s=3)
            except PeerError:
                pass
            else:
                raise AssertionError("a refused peer was answered")
            # The gate still works for honest peers afterwards.
            await friend.connect(a.addrs[0])
            await until(lambda: gate_a.allows(friend.peer_id))
            nursery.cancel_scope.cancel()

    run(main)


def test_a_wrong_proof_sent_to_the_answering_side_is_banned() -> None:
    async def main() -> None:
        async with (
            open_host(Identity.generate(), 0) as a,
            open_host(Identity.generate(), 0) as forger,
        ):
            gate_a, peers_a = gated(a, OURS)
            await forger.connect(a.addrs[0])
            async with await forger.open_stream(a.peer_id, AUTH_PROTOCOL) as stream:
                challenge = (await stream.recv(5))["challenge"]
                assert isinstance(challenge, bytes) and len(challenge) == 32
                await stream.send({"proof": b"\x00" * 32, "challenge": b"\x01" * 32})
                with trio.move_on_after(5):
                    await until(lambda: peers_a.is_banned(forger.peer_id, time.time()))
            assert peers_a.is_banned(forger.peer_id, time.time())
            assert not gate_a.allows(forger.peer_id)

    run(main)
