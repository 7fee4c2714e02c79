"""The swarm's model catalog: three DHT participants on 127.0.0.1 in one trio run.

Each node announces a different model list (its `IndexRecord`); every node's `models()`
must list every node's models, and a node's models must leave every list when it
withdraws (at once) or stops republishing (once its index expires). The first tests drive
`Discovery` with the shared fake clock of test_discovery.py; the last runs three
`SwarmPresence`s, whose index is republished with their records and withdrawn on stop.
Lookups are awaited or polled against a deadline; nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from swarmd.dht.discovery import WITHDRAW_TTL_S
from swarmd.dht.index import CatalogModel, ModelEntry, catalog_key, decode_index, index_key
from swarmd.dht.records import NodeRecord
from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.net.host import P2PHost
from swarmd.net.identity import Identity
from tests.integration.conftest import host_record
from tests.integration.test_discovery import (
    LOOKUP_DEADLINE_S,
    TTL_S,
    FakeClock,
    Node,
    run,
    swarm,
)

LISTS = {
    "A": (ModelEntry("alpha-1b", "aa" * 32, 24, 4096), ModelEntry("shared-7b", "", 32, 8192)),
    "B": (ModelEntry("beta-3b", "bb" * 32, 28, 32768),),
    "C": (ModelEntry("gamma-135m", "", 30, 2048), ModelEntry("shared-7b", "cc" * 32, 32, 8192)),
}
ALL_IDS = ["alpha-1b", "beta-3b", "gamma-135m", "shared-7b"]

Models = Callable[[], Awaitable[list[CatalogModel]]]


async def models_become(models: Models, expected: Sequence[str]) -> list[CatalogModel]:
    """`models()` again and again until it lists exactly `expected` (the last answer),
    failing after LOOKUP_DEADLINE_S. Each try is a DHT lookup: no sleep between them."""
    found: list[CatalogModel] = []
    with trio.move_on_after(LOOKUP_DEADLINE_S):
        while True:
            found = await models()
            if [m.model_id for m in found] == list(expected):
                return found
            await trio.lowlevel.checkpoint()
    raise AssertionError(f"models() still {[m.model_id for m in found]}, not {list(expected)}")


async def announce(node: Node, clock: FakeClock) -> None:
    await node.disc.announce_index(node.identity, LISTS[node.name], clock() + TTL_S)


def test_each_node_lists_every_nodes_models_until_it_withdraws_or_expires() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABC", clock) as n:
            for name in "BC":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            for name in "ABC":
                await announce(n[name], clock)

            for viewer in "ABC":
                found = await models_become(n[viewer].disc.models, ALL_IDS)
                by_id = {m.model_id: m for m in found}
                a, c = n["A"].host.peer_id, n["C"].host.peer_id
                assert by_id["beta-3b"].listed_by == ((n["B"].host.peer_id, LISTS["B"][0]),)
                assert by_id["shared-7b"].listed_by == tuple(
                    sorted([(a, LISTS["A"][1]), (c, LISTS["C"][1])])
                )
                assert len(by_id["shared-7b"].variants) == 2  # two content ids of one id
            indexes = await n["B"].disc.indexes()
            assert [i.peer_id for i in indexes] == sorted(n[x].host.peer_id for x in "ABC")
            assert all(i.expires_at == clock() + TTL_S for i in indexes)
            assert n["B"].disc.stats.rejected_total == 0

            # B withdraws: its model leaves every list at once, its own included.
            await n["B"].disc.withdraw_index(n["B"].identity)
            without_b = ["alpha-1b", "gamma-135m", "shared-7b"]
            for viewer in "ABC":
                await models_become(n[viewer].disc.models, without_b)
            # A withdrawn provider loses its slot of the catalog key where it was seen.
            key = catalog_key().encode()
            kept = {str(p.peer_id) for p in n["A"].disc.dht.provider_store.get_providers(key)}
            assert n["B"].host.peer_id not in kept
            # Announcing again (a higher seq) beats the withdrawal at once.
            await announce(n["B"], clock)
            await models_become(n["C"].disc.models, ALL_IDS)

            # C stops republishing (killed, no withdrawal): its index expires; A and B renew.
            clock.advance(TTL_S + 1)
            for name in "AB":
                await announce(n[name], clock)
            for viewer in "ABC":
                found = await models_become(
                    n[viewer].disc.models, ["alpha-1b", "beta-3b", "shared-7b"]
                )
                shared = next(m for m in found if m.model_id == "shared-7b")
                assert shared.peers == (n["A"].host.peer_id,)
            assert n["A"].disc.stats.rejected.get("expired", 0) >= 1

    run(body)


def test_a_made_up_provider_and_a_replayed_index_list_nothing() -> None:
    clock = FakeClock()

    async def body() -> None:
        async with swarm("ABM", clock) as n:
            for name in "BM":
                await n[name].disc.bootstrap(n["A"].host.addrs)
            await announce(n["B"], clock)
            # M claims the catalog and lists nothing: what its ADD_PROVIDER leaves on A.
            key = catalog_key().encode()
            m_id = ID.from_base58(n["M"].host.peer_id)
            m_addrs = [Multiaddr(a.partition("/p2p/")[0]) for a in n["M"].host.addrs]
            n["A"].disc.dht.provider_store.add_provider(key, PeerInfo(m_id, m_addrs))
            await models_become(n["A"].disc.models, ["beta-3b"])
            kept = {str(p.peer_id) for p in n["A"].disc.dht.provider_store.get_providers(key)}
            assert n["M"].host.peer_id not in kept
            # Someone keeps B's index, and stores it again once B has withdrawn and the
            # withdrawal's shortest life is over: the withdrawal (a higher seq) still wins.
            b_key = index_key(n["B"].host.peer_id).encode()
            captured = n["A"].disc.dht.value_store.get(b_key).value
            await n["B"].disc.withdraw_index(n["B"].identity)
            await models_become(n["A"].disc.models, [])
            clock.advance(WITHDRAW_TTL_S + 1)
            n["A"].disc.dht.value_store.put(b_key, captured)
            assert decode_index(captured, clock()).models == LISTS["B"]
            await models_become(n["A"].disc.models, [])

    run(body)


# --- the same through SwarmPresence: republished with the records, withdrawn on stop --


def presence(
    name: str, bootstrap: tuple[str, ...] = (), lists: dict[str, list[ModelEntry]] | None = None
) -> SwarmPresence:
    """A presence serving LISTS[name]; its index lists `lists[name]` (LISTS[name] if no
    `lists`), read at every announcement."""

    def make_records(host: P2PHost) -> list[NodeRecord]:
        return [host_record(host, LISTS[name][0].model_id)]

    def make_index(host: P2PHost) -> list[ModelEntry]:
        return list(lists[name]) if lists is not None else list(LISTS[name])

    settings = SwarmSettings("127.0.0.1", 0, bootstrap, republish_interval_s=60.0)
    return SwarmPresence(Identity.generate(), settings, make_records, make_index=make_index)


class Running:
    """One presence run in its own cancel scope, so a test can stop it alone."""

    def __init__(self, presence: SwarmPresence) -> None:
        self.presence = presence
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()

    async def run(self) -> None:
        with self.scope:
            await self.presence.run()
        self.stopped.set()

    async def stop(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()  # run() has withdrawn (or given up) by now


async def start(nursery: trio.Nursery, swarm_presence: SwarmPresence) -> Running:
    running = Running(swarm_presence)
    nursery.start_soon(running.run)
    await swarm_presence.wait_ready()
    return running


def test_presences_announce_their_index_with_their_records_and_withdraw_it_on_stop() -> None:
    async def body() -> None:
        async with trio.open_nursery() as nursery:
            a = await start(nursery, presence("A"))
            bootstrap = (a.presence.addrs[0],)
            b = await start(nursery, presence("B", bootstrap))
            c_lists = {"C": list(LISTS["C"])}
            c = await start(nursery, presence("C", bootstrap, c_lists))
            try:
                for viewer in (a, b, c):
                    await models_become(viewer.presence.models, ALL_IDS)
                # The index expires with the records it was announced with.
                own = {r.peer_id: r for r in await a.presence.holders("alpha-1b")}
                index = next(
                    i
                    for i in await b.presence.discovery.indexes()
                    if i.peer_id == a.presence.identity.peer_id
                )
                assert index.expires_at == own[index.peer_id].expires_at

                await b.stop()  # withdraws its record, then its index
                for viewer in (a, c):
                    await models_become(
                        viewer.presence.models, ["alpha-1b", "gamma-135m", "shared-7b"]
                    )
                    assert await viewer.presence.holders("beta-3b") == []

                # C's next announcement lists nothing: it leaves the catalog, keeps serving.
                c_lists["C"] = []
                await c.presence.announce_now()
                await models_become(a.presence.models, ["alpha-1b", "shared-7b"])
                assert [r.peer_id for r in await a.presence.holders("gamma-135m")] == [
                    c.presence.identity.peer_id
                ]
            finally:
                for running in (a, b, c):
                    await running.stop()

    run(body)
