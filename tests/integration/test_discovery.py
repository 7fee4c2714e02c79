"""DHT discovery: several libp2p hosts on 127.0.0.1 in one trio run.

Each test builds a small swarm (A first, the others bootstrapping from A), publishes
signed records and looks them up from a node that bootstrapped from A only. A fake clock,
shared by every node, decides expiry; announcements are awaited, so no test sleeps.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import msgpack
import pytest
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from swarmd.dht.discovery import WITHDRAW_TTL_S, Discovery, RecordValidator, open_discovery
from swarmd.dht.records import (
    NodeRecord,
    RecordStats,
    decode_record,
    model_key,
    record_key,
    sign_record,
)
from swarmd.errors import (
    BadSignatureError,
    DialError,
    ExpiredRecordError,
    MalformedRecordError,
    PeerError,
    RecordError,
)
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity

RUN_DEADLINE_S = 20.0
LOOKUP_DEADLINE_S = 10.0
TTL_S = 60.0


class FakeClock:
    """Unix time that only moves when a test says so."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Node:
    name: str
    identity: Identity
    host: P2PHost
    disc: Discovery

    def record(self, model_id: str, start: int, end: int, clock: FakeClock) -> NodeRecord:
        return NodeRecord(
            peer_id=self.identity.peer_id,
            model_id=model_id,
            model_hash="",
            layer_start=start,
            layer_end=end,
            num_layers=30,
            dtype="float16",
            weights="fp32",
            free_kv_tokens=4096,
            kv_budget_tokens=4096,
            throughput_tps=12.5,
            state="ready",
            addrs=tuple(self.host.addrs),
            api_url="",
            version="0.1.0",
            expires_at=clock() + TTL_S,
        )

    async def announce(self, model_id: str, start: int, end: int, clock: FakeClock) -> None:
        await self.disc.announce(self.identity, self.record(model_id, start, end, clock))


@asynccontextmanager
async def swarm(names: str, clock: FakeClock) -> AsyncIterator[dict[str, Node]]:
    """One node per letter of `names`, each with a DHT; none connected yet."""
    async with AsyncExitStack() as stack:
        nodes = {}
        for name in names:
            identity = Identity.generate()
            host = await stack.enter_async_context(open_host(identity, 0))
            disc = await stack.enter_async_context(open_discovery(host, clock))
            nodes[name] = Node(name, identity, host, disc)
        yield nodes


def run(test: Callable[[], Awaitable[None]], deadline_s: float = RUN_DEADLINE_S) -> None:
    async def main() -> None:
        with trio.fail_after(deadline_s):
            await test()

    trio.run(main)


def layers(records: list[NodeRecord]) -> list[tuple[str, int, int]]:
    return [(r.peer_id, r.layer_start, r.layer_end) for r in records]


async def holders_within(node: Node, model_id: str) -> tuple[list[NodeRecord], float]:
    start = trio.current_time()
    with trio.fail_after(LOOKUP_DEADLINE_S):
        found = await node.disc.holders(model_id)
    return found, trio.current_time() - start


def test_late_joiner_finds_every_holder_with_its_layers() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABCDE", clock) as n:
            a_addr = n["A"].host.addrs
            for name in "BCD":
                assert await n[name].disc.bootstrap(a_addr) == [n["A"].host.peer_id]
            await n["B"].announce("m", 0, 15, clock)
            await n["C"].announce("m", 15, 30, clock)
            await n["D"].announce("m", 0, 30, clock)

            # E joins after the announcements and knows only A.
            t0 = trio.current_time()
            assert await n["E"].disc.bootstrap(a_addr) == [n["A"].host.peer_id]
            joined_s = trio.current_time() - t0
            expected = sorted(
                [
                    (n["B"].host.peer_id, 0, 15),
                    (n["C"].host.peer_id, 15, 30),
                    (n["D"].host.peer_id, 0, 30),
                ]
            )
            found, lookup_s = await holders_within(n["E"], "m")
            assert layers(found) == expected
            assert all(r.model_id == "m" and r.state == "ready" for r in found)
            assert {n[x].host.peer_id for x in "BCD"} <= set(n["E"].disc.routing_table_peers())
            # A second lookup (E now caches) gives the same answer; so does A's.
            assert layers(await n["E"].disc.holders("m")) == expected
            assert layers(await n["A"].disc.holders("m")) == expected
            # A holder lists itself; an unknown model has no holders.
            assert layers(await n["B"].disc.holders("m")) == expected
            assert await n["E"].disc.holders("no-such-model") == []
            assert n["E"].disc.stats.rejected_total == 0
            print(f"\nE bootstrap {joined_s * 1000:.0f} ms, holders('m') {lookup_s * 1000:.0f} ms")

    run(body)


def test_holder_that_stops_republishing_disappears_after_expiry() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABCDE", clock) as n:
            for name in "BCDE":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            await n["B"].announce("m", 0, 15, clock)
            await n["C"].announce("m", 15, 30, clock)
            await n["D"].announce("m", 0, 30, clock)
            found, _ = await holders_within(n["E"], "m")
            assert [r.peer_id for r in found] == sorted(n[x].host.peer_id for x in "BCD")

            clock.advance(TTL_S + 1)  # every record has expired; B and D republish
            await n["B"].announce("m", 0, 15, clock)
            await n["D"].announce("m", 0, 30, clock)
            expected = sorted([(n["B"].host.peer_id, 0, 15), (n["D"].host.peer_id, 0, 30)])
            for viewer in "EA":
                found, _ = await holders_within(n[viewer], "m")
                assert layers(found) == expected
                assert n[viewer].disc.stats.rejected.get("expired", 0) >= 1
            assert all(r.expires_at > clock() for r in found)

    run(body)


def forged_value(owner: Identity, signer: Identity, record: NodeRecord) -> bytes:
    """`record` (of `owner`) carrying `signer`'s signature: canonical, but forged."""
    fields = msgpack.unpackb(
        sign_record(signer, dataclasses.replace(record, peer_id=signer.peer_id)), raw=False
    )
    fields["peer_id"] = owner.peer_id
    return msgpack.packb(fields, use_bin_type=True)


def test_forged_expired_and_malformed_records_are_refused_and_counted() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABME", clock) as n:
            for name in "BME":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            mallory, e = n["M"], n["E"]

            def forged(model_id: str) -> bytes:
                record = mallory.record(model_id, 0, 30, clock)
                return forged_value(mallory.identity, Identity.generate(), record)

            def expired(model_id: str) -> bytes:
                record = mallory.record(model_id, 0, 30, clock)
                stale = dataclasses.replace(record, expires_at=clock() - 1)
                return sign_record(mallory.identity, stale)

            bad = {
                "m-forged": (forged("m-forged"), BadSignatureError),
                "m-expired": (expired("m-expired"), ExpiredRecordError),
                "m-malformed": (b"\x93not a record", MalformedRecordError),
            }
            for model_id, (value, error) in bad.items():
                await n["B"].announce(model_id, 0, 30, clock)
                key = record_key(model_id, mallory.host.peer_id)
                # 1. The DHT refuses it at the source...
                with pytest.raises(error):
                    await mallory.disc.dht.put_value(key, value)
                # 2. ...and at every peer it is pushed to, bypassing the source's check.
                key_bytes = key.encode()
                mallory.disc.dht.value_store.put(key_bytes, value)
                for peer in ("A", "E"):
                    pid = ID.from_base58(n[peer].host.peer_id)
                    stored = await mallory.disc.dht.value_store._store_at_peer(
                        pid, key_bytes, value
                    )
                    assert not stored
                    assert n[peer].disc.dht.value_store.get(key_bytes) is None
                # 3. Mallory claims the model; lookups still return only B.
                await mallory.disc.dht.provide(model_key(model_id))
                found, _ = await holders_within(e, model_id)
                assert [r.peer_id for r in found] == [n["B"].host.peer_id]
            for node in (mallory, e):
                for reason in ("bad_signature", "expired", "malformed"):
                    assert node.disc.stats.rejected.get(reason, 0) >= 1, (node.name, reason)

    run(body)


def test_withdraw_removes_the_holder_at_once() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABCE", clock) as n:
            for name in "BCE":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            b_record = n["B"].record("m", 0, 15, clock)
            await n["B"].disc.announce(n["B"].identity, b_record)
            await n["C"].announce("m", 15, 30, clock)
            found, _ = await holders_within(n["E"], "m")
            assert [r.peer_id for r in found] == sorted(n[x].host.peer_id for x in "BC")

            await n["B"].disc.withdraw(n["B"].identity, b_record)
            for viewer in "EAB":
                found, _ = await holders_within(n[viewer], "m")
                assert [r.peer_id for r in found] == [n["C"].host.peer_id], viewer

            # A later announcement (a higher seq) beats the withdrawal at once: B serves again.
            await n["B"].announce("m", 0, 15, clock)
            found, _ = await holders_within(n["E"], "m")
            assert [r.peer_id for r in found] == sorted(n[x].host.peer_id for x in "BC")

    run(body)


def test_a_replayed_ready_record_never_undoes_a_withdrawal() -> None:
    """Before: once the short-lived withdrawal expired, anyone who had kept B's earlier
    "ready" record could store it again, and B was listed as a holder once more."""
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABME", clock) as n:
            for name in "BME":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            b = n["B"]
            b_record = b.record("m", 0, 30, clock)
            await b.disc.announce(b.identity, b_record)
            key = record_key("m", b.host.peer_id)
            key_bytes = key.encode()
            captured = n["A"].disc.dht.value_store.get(key_bytes).value  # Mallory keeps it
            assert decode_record(captured, clock()).state == "ready"
            await b.disc.withdraw(b.identity, b_record)
            clock.advance(WITHDRAW_TTL_S + 1)  # past a withdrawal's minimum life

            mallory = n["M"].disc.dht.value_store
            for peer in "AE":
                pid = ID.from_base58(n[peer].host.peer_id)
                await mallory._store_at_peer(pid, key_bytes, captured)
                kept = n[peer].disc.dht.value_store.get(key_bytes).value
                assert decode_record(kept, clock()).state == "draining", peer
            # Even a node that never saw the withdrawal (the replay straight in its store)
            # asks the network and the owner, and the higher seq wins there.
            n["E"].disc.dht.value_store.put(key_bytes, captured)
            for viewer in "EA":
                found, _ = await holders_within(n[viewer], "m")
                assert found == [], viewer

    run(body)


def test_twenty_made_up_providers_do_not_hide_an_honest_holder() -> None:
    """Before: libp2p kept the first 20 providers of a key and ignored every later one,
    so 20 throwaway peer ids claiming a model first hid its honest holder everywhere."""
    clock = FakeClock()

    async def body() -> None:
        async with swarm("AHE", clock) as n:
            for name in "HE":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            with trio.socket.socket() as sock:  # a port nobody listens on
                await sock.bind(("127.0.0.1", 0))
                dead_port = sock.getsockname()[1]
            nowhere = [Multiaddr(f"/ip4/127.0.0.1/tcp/{dead_port}")]
            fakes = [ID.from_base58(Identity.generate().peer_id) for _ in range(20)]
            key = model_key("m").encode()
            for node in n.values():  # what 20 ADD_PROVIDERs from 20 fresh ids leave
                for fake in fakes:
                    node.disc.dht.provider_store.add_provider(key, PeerInfo(fake, nowhere))
            honest = n["H"]
            await honest.announce("m", 0, 30, clock)

            found, _ = await holders_within(n["E"], "m")  # within LOOKUP_DEADLINE_S
            assert [r.peer_id for r in found] == [honest.host.peer_id]
            # The providers with no record behind them lost their slots on E.
            left = {p.peer_id for p in n["E"].disc.dht.provider_store.get_providers(key)}
            assert left.isdisjoint(fakes)
            found, _ = await holders_within(n["A"], "m")
            assert [r.peer_id for r in found] == [honest.host.peer_id]

    # Each lookup dials every made-up provider (a small swarm's lookups start from the
    # whole peerstore): slower than the other tests, though each lookup is bounded.
    run(body, deadline_s=2 * RUN_DEADLINE_S)


def test_bootstrap_names_a_bad_or_unreachable_address() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABC", clock) as n:
            a_addr = n["A"].host.addrs[0]
            gone = Identity.generate().peer_id
            with trio.socket.socket() as sock:  # a port nobody listens on
                await sock.bind(("127.0.0.1", 0))
                dead_port = sock.getsockname()[1]
            for addr in (
                "not-a-multiaddr",
                f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{gone}",
                n["B"].host.addrs[0],  # itself
            ):
                with pytest.raises(DialError, match=re.escape(addr)):
                    await n["B"].disc.bootstrap([addr])
            assert await n["B"].disc.bootstrap([a_addr]) == [n["A"].host.peer_id]
            assert n["A"].host.peer_id in n["B"].disc.routing_table_peers()

            # A peer that connects on its own (not over the DHT) is added explicitly.
            await n["C"].host.connect(a_addr)
            assert n["C"].host.peer_id not in n["A"].disc.routing_table_peers()
            assert await n["A"].disc.add_peer(n["C"].host.peer_id)
            assert n["C"].host.peer_id in n["A"].disc.routing_table_peers()
            with pytest.raises(PeerError):
                await n["A"].disc.add_peer("not-a-peer-id")
            with pytest.raises(PeerError):
                await n["A"].disc.add_peer(n["C"].host.peer_id, [a_addr])  # A's, not C's
            # A peer known only by an address someone gave us (not connected).
            assert await n["C"].disc.add_peer(n["B"].host.peer_id, n["B"].host.addrs)
            assert n["B"].host.peer_id in n["C"].disc.routing_table_peers()

    run(body)


def test_validator_prefers_withdrawals_then_later_expiry_and_counts_refusals() -> None:
    clock = FakeClock()
    owner = Identity.generate()
    stats = RecordStats()
    validator = RecordValidator(clock, stats)
    base = NodeRecord(
        peer_id=owner.peer_id,
        model_id="m",
        model_hash="",
        layer_start=0,
        layer_end=30,
        num_layers=30,
        dtype="float16",
        weights="fp32",
        free_kv_tokens=0,
        kv_budget_tokens=4096,
        throughput_tps=0.0,
        state="ready",
        addrs=(),
        api_url="",
        version="0.1.0",
        expires_at=clock() + TTL_S,
    )
    key = record_key("m", owner.peer_id)
    ready = sign_record(owner, base)
    later = sign_record(owner, dataclasses.replace(base, expires_at=clock() + 2 * TTL_S))
    draining = sign_record(
        owner, dataclasses.replace(base, state="draining", expires_at=clock() + 1)
    )
    expired = sign_record(owner, dataclasses.replace(base, expires_at=clock() - 1))
    assert validator.select(key, [ready, later]) == 1
    assert validator.select(key, [later, ready]) == 0
    assert validator.select(key, [later, draining, ready]) == 1
    assert validator.select(key, [expired, b"junk", ready]) == 2
    assert validator.select(key, [ready, ready]) == 1  # a copy of what is stored is taken
    clock.advance(2)  # the withdrawal has expired: a new announcement beats it
    assert validator.select(key, [draining, ready]) == 1
    # The owner's later record (a higher seq) wins whatever its state and expiry.
    old = sign_record(owner, dataclasses.replace(base, seq=1, expires_at=clock() + TTL_S))
    gone = sign_record(
        owner, dataclasses.replace(base, seq=2, state="draining", expires_at=clock() + 10)
    )
    again = sign_record(owner, dataclasses.replace(base, seq=3, expires_at=clock() + 5))
    assert validator.select(key, [old, gone]) == 1
    assert validator.select(key, [gone, old]) == 0
    assert validator.select(key, [again, gone, old]) == 0

    validator.validate(key, ready)
    for value, error in ((expired, ExpiredRecordError), (b"junk", MalformedRecordError)):
        with pytest.raises(error):
            validator.validate(key, value)
    with pytest.raises(RecordError):
        validator.validate(record_key("other", owner.peer_id), ready)  # not its key
    assert stats.as_dict() == {
        "accepted": 1,
        "rejected_expired": 1,
        "rejected_malformed": 1,
        "rejected_wrong_owner": 1,
    }
