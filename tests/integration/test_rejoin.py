"""Start order does not matter: a presence whose bootstrap peer is down serves meanwhile,
joins when the peer comes up, comes back by itself after the peer restarts, and finds
its way back through the peers it remembered when it has no bootstrap peer at all."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.errors import ConfigError
from swarmd.net.identity import Identity
from swarmd.net.known_peers import KnownPeers
from tests.integration.conftest import host_records
from tests.integration.test_catalog import Running, start
from tests.integration.test_discovery import run

JOIN_DEADLINE_S = 30.0  # the retries back off to 15 s; a join takes one or two


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def presence(
    identity: Identity, port: int, bootstrap: tuple[str, ...], known: Path | None
) -> SwarmPresence:
    settings = SwarmSettings(
        "127.0.0.1", port, bootstrap, republish_interval_s=60.0, known_peers_path=known
    )
    return SwarmPresence(identity, settings, host_records)


POLL_S = 0.1


async def until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(int(JOIN_DEADLINE_S / POLL_S)):
        if predicate():
            return
        await trio.sleep(POLL_S)
    raise AssertionError(f"not within {JOIN_DEADLINE_S:g} s: {what}")


async def holds(viewer: SwarmPresence, peer_id: str) -> bool:
    return any(r.peer_id == peer_id for r in await viewer.holders("m"))


async def until_holds(viewer: SwarmPresence, peer_id: str) -> None:
    with trio.move_on_after(JOIN_DEADLINE_S):
        for _ in range(int(JOIN_DEADLINE_S / POLL_S)):
            if await holds(viewer, peer_id):
                return
            await trio.sleep(POLL_S)
    raise AssertionError(f"{peer_id[-8:]}'s record not seen within {JOIN_DEADLINE_S:g} s")


def test_a_node_whose_bootstrap_is_down_joins_when_it_comes_up_and_after_it_restarts(
    tmp_path: Path,
) -> None:
    a_identity, a_port = Identity.generate(), free_port()
    a_addr = f"/ip4/127.0.0.1/tcp/{a_port}/p2p/{a_identity.peer_id}"
    b_known = tmp_path / "b" / "known_peers.json"

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            b = presence(Identity.generate(), 0, (a_addr,), b_known)
            b_run = await start(nursery, b)  # ready although its only bootstrap is down
            assert b.joining and b.failure is None
            assert await holds(b, b.identity.peer_id)  # it serves what it holds meanwhile

            a_run = await start(nursery, presence(a_identity, a_port, (), None))
            a = a_run.presence
            await until(lambda: not b.joining, "B joined once A came up")
            await until_holds(a, b.identity.peer_id)  # B announced to A at once
            await until(lambda: a_addr in KnownPeers(b_known).addrs, "B remembered A")

            # A restarts (same key, same port, an empty DHT): B sees it lost every peer,
            # retries, and announces itself again without anyone telling it to.
            await a_run.stop()
            await until(lambda: b.joining, "B noticed it lost its only peer")
            a_run = await start(nursery, presence(a_identity, a_port, (), None))
            await until(lambda: not b.joining, "B joined A again")
            await until_holds(a_run.presence, b.identity.peer_id)
            for running in (b_run, a_run):
                await running.stop()

    run(body, deadline_s=4 * JOIN_DEADLINE_S)


def test_a_node_without_bootstrap_finds_its_way_back_through_the_peers_it_met(
    tmp_path: Path,
) -> None:
    """The swarm's first node restarts with nothing but its data dir, after the others
    lost their way to it: it dials the peers it remembered."""
    a_identity, b_identity = Identity.generate(), Identity.generate()
    a_known, b_port = tmp_path / "a" / "known_peers.json", free_port()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            a_run = await start(nursery, presence(a_identity, 0, (), a_known))
            a_addr = a_run.presence.addrs[0]
            b_run = await start(nursery, presence(b_identity, b_port, (a_addr,), None))
            await until(lambda: bool(KnownPeers(a_known).addrs), "A remembered B")
            assert all(a.endswith(f"/p2p/{b_identity.peer_id}") for a in KnownPeers(a_known).addrs)
            for running in (a_run, b_run):
                await running.stop()

            # B comes back alone (no bootstrap: it cannot find A), then A on a new port.
            b_run = await start(nursery, presence(b_identity, b_port, (), None))
            a_run = await start(nursery, presence(a_identity, 0, (), a_known))
            a, b = a_run.presence, b_run.presence
            assert not a.joining and not b.joining  # alone by design, not waiting
            await until_holds(a, b_identity.peer_id)
            await until_holds(b, a_identity.peer_id)
            for running in (b_run, a_run):
                await running.stop()

    run(body, deadline_s=4 * JOIN_DEADLINE_S)


def test_a_malformed_bootstrap_address_is_refused_rather_than_retried() -> None:
    async def body() -> None:
        async with trio.open_nursery() as nursery:
            bad = presence(Identity.generate(), 0, ("/ip4/127.0.0.1/tcp/1/p2p/nope",), None)
            running = Running(bad)
            nursery.start_soon(running.run)
            with pytest.raises(ConfigError, match="--bootstrap"):
                await bad.wait_ready()
            await running.stop()

    run(body)
