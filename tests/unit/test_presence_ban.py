"""`SwarmPresence.ban`: one lost peer fails every session it served, and each session
reports it; the peer is banned, logged and cut off once per incident, not once per
session, and every report counts as one of its failures (`/api/peers`)."""

from __future__ import annotations

import logging
import time

import pytest
import trio

from swarmd.dht.swarm import SwarmPresence
from swarmd.net.peers import BanPolicy, PeerTable


class _View:
    def __init__(self) -> None:
        self.refreshes = 0

    def refresh_soon(self) -> None:
        self.refreshes += 1


def test_seven_sessions_reporting_one_lost_peer_ban_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    swarm = SwarmPresence.__new__(SwarmPresence)
    swarm.peers = PeerTable(ban_policy=BanPolicy())
    swarm._host = None
    swarm.view = _View()  # type: ignore[assignment]

    async def reports() -> None:
        for _ in range(7):
            await swarm.ban("peer-lost-midway", "lost: stream closed by peer")
        await swarm.ban("another-peer", "bad frame")

    with caplog.at_level(logging.WARNING, logger="swarmd.dht.swarm"):
        trio.run(reports)
    said = [r.getMessage() for r in caplog.records if "peer banned" in r.getMessage()]
    assert len(said) == 2 and "dway" in said[0] and "-peer" in said[1]
    assert swarm.view.refreshes == 2
    banned = {row.peer_id: row for row in swarm.peers.bans(time.time())}
    assert banned["peer-lost-midway"].offences == 1 and "another-peer" in banned
    lost = swarm.peers.get("peer-lost-midway")
    assert lost is not None and lost.failures == 7
