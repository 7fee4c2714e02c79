"""The private-swarm gate against peers with the key, another key, or hostile answers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.peer.id import ID

from swarmd.dht.discovery import open_discovery
from swarmd.dht.records import model_key, record_key, sign_record
from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.errors import PeerError
from swarmd.net.auth import SwarmKey
from swarmd.net.frames import FrameStream
from swarmd.net.gate import AUTH_PROTOCOL, SwarmGate
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.peers import PeerTable
from swarmd.net.rpc import RpcService, call_ping
from tests.integration.conftest import host_record

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


def _private(key: SwarmKey, bootstrap: tuple[str, ...] = ()) -> SwarmPresence:
    settings = SwarmSettings("127.0.0.1", 0, bootstrap, republish_interval_s=60.0, swarm_key=key)
    return SwarmPresence(
        Identity.generate(), settings, lambda host: [host_record(host, "private-model")]
    )


def test_outsiders_can_neither_read_nor_store_records_of_a_private_swarm() -> None:
    """Before: the gate covered swarmd's protocols only, and libp2p's Kademlia handler
    answered anyone: an outsider read every record and stored its own."""

    async def main() -> None:
        with trio.fail_after(30):
            a = _private(OURS)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.run)
                await a.wait_ready()
                insider = _private(OURS, (a.addrs[0],))
                nursery.start_soon(insider.run)
                await insider.wait_ready()  # joined through a's DHT and announced
                key = record_key("private-model", insider.identity.peer_id).encode()
                a_pid = ID.from_base58(a.identity.peer_id)
                # The insider's record is stored on a, and an insider reads it back.
                assert a.discovery.dht.value_store.get(key) is not None
                read = await insider.discovery.dht.value_store._get_from_peer(a_pid, key)
                assert read == a.discovery.dht.value_store.get(key).value

                outsider_id = Identity.generate()
                async with (
                    open_host(outsider_id, 0) as outsider,
                    open_discovery(outsider) as outsider_dht,
                ):
                    await outsider.connect(a.addrs[0])
                    store = outsider_dht.dht.value_store
                    assert await store._get_from_peer(a_pid, key) is None
                    ask_providers = (
                        outsider_dht.dht.provider_store._get_providers_from_peer_with_closers
                    )
                    providers, _ = await ask_providers(a_pid, model_key("private-model").encode())
                    assert providers == []
                    own = host_record(outsider, "private-model")
                    own_key = record_key("private-model", outsider.peer_id).encode()
                    value = sign_record(outsider_id, own)
                    assert not await store._store_at_peer(a_pid, own_key, value)
                    assert a.discovery.dht.value_store.get(own_key) is None
                    assert outsider.peer_id not in a.discovery.routing_table_peers()
                nursery.cancel_scope.cancel()

    run(main)
