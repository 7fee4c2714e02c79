"""The swarm layer outlives one bad event: every background loop survives any error.

Before: an unexpected exception in the renewal or the ping loop (or a PeerError that trio
delivered inside an exception group) ended `SwarmPresence.run` for good; the node kept
its API up but no longer renewed its records, pinged, or served the swarm.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio

import swarmd.dht.swarm as swarm_module
from swarmd.api.metrics import NodeMetrics, NodeState
from swarmd.dht.records import NodeRecord
from swarmd.dht.swarm import SwarmPresence, SwarmSettings
from swarmd.errors import DialError
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.rpc import RpcService
from tests.integration.conftest import host_records
from tests.trio_run import run_trio

DEADLINE_S = 20.0
SETTINGS = SwarmSettings(
    listen_host="127.0.0.1", listen_port=0, bootstrap=(), republish_interval_s=0.05
)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polling the presence's state
            await trio.sleep(0.02)


def run(test: Callable[[], Awaitable[None]]) -> None:
    run_trio(test, DEADLINE_S)


def test_renewal_goes_on_after_any_error_and_counts_it() -> None:
    async def body() -> None:
        presence = SwarmPresence(Identity.generate(), SETTINGS, host_records)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(presence.run)
            await presence.wait_ready()
            discovery = presence.discovery
            real_announce = discovery.announce
            calls: list[int] = []

            async def flaky(identity: Identity, record: NodeRecord) -> None:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("a library bug")
                if len(calls) == 2:
                    raise ExceptionGroup("from a nursery", [ValueError("odd answer")])
                await real_announce(identity, record)

            discovery.announce = flaky  # type: ignore[method-assign]
            await until(lambda: len(calls) >= 4)  # the rounds after the errors ran
            assert presence.failure is None
            assert presence.loop_errors.as_dict() == {"renew": 2}
            nursery.cancel_scope.cancel()

    run(body)


def test_pings_go_on_and_a_grouped_peer_error_counts_as_a_failed_ping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(swarm_module, "PING_INTERVAL_S", 0.05)
    real_ping = swarm_module.call_ping
    calls: list[str] = []

    async def flaky_ping(host: P2PHost, peer_id: str, timeout_s: float) -> float:
        calls.append(peer_id)
        if len(calls) == 1:  # trio wraps even one error of a nursery in a group
            raise ExceptionGroup("ping", [DialError("stream reset", peer_id)])
        if len(calls) == 2:
            raise RuntimeError("a library bug")
        return await real_ping(host, peer_id, timeout_s=timeout_s)

    monkeypatch.setattr(swarm_module, "call_ping", flaky_ping)

    async def body() -> None:
        presence = SwarmPresence(Identity.generate(), SETTINGS, None)
        async with (
            open_host(Identity.generate(), 0) as other,
            trio.open_nursery() as nursery,
        ):
            RpcService(other)  # answers pings
            nursery.start_soon(presence.run)
            await presence.wait_ready()
            await other.connect(presence.addrs[0])

            def measured() -> bool:
                row = presence.peers.get(other.peer_id)
                return row is not None and row.rtt_ms is not None

            await until(measured)
            row = presence.peers.get(other.peer_id)
            assert row is not None and row.failures == 1  # the grouped PeerError
            assert presence.failure is None
            assert presence.loop_errors.as_dict() == {"ping": 1}  # the RuntimeError
            nursery.cancel_scope.cancel()

    run(body)


def test_services_that_fail_do_not_stop_the_swarm_layer() -> None:
    async def broken_services(host: P2PHost) -> None:
        raise RuntimeError("the stage service could not start")

    async def body() -> None:
        presence = SwarmPresence(Identity.generate(), SETTINGS, host_records, broken_services)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(presence.run)
            await presence.wait_ready()
            await until(lambda: presence.loop_errors.as_dict() == {"services": 1})
            await presence.announce_now()  # the DHT still works
            assert presence.failure is None
            assert [r.peer_id for r in await presence.holders("m")] == [presence.identity.peer_id]
            nursery.cancel_scope.cancel()

    run(body)


def test_background_errors_are_a_metric() -> None:
    state = NodeState(
        info=lambda: {},
        peers_connected=lambda: 0,
        kv_cache_tokens=lambda: 0,
        sessions=lambda: 0,
        in_flight=lambda: 0,
        bytes_sent=dict,
        bytes_received=dict,
        records_rejected=dict,
        peers_banned=lambda: 0,
        background_errors=lambda: {"ping": 2, "renew": 1},
    )
    text = NodeMetrics(state).render().decode()
    assert 'swarmd_background_errors_total{loop="ping"} 2.0' in text
    assert 'swarmd_background_errors_total{loop="renew"} 1.0' in text
