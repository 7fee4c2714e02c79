"""`SwarmPresence.ban` and `lose`: one bad or lost peer fails every session it served,
and each session reports it; the peer is banned (or, lost, sits out), logged and cut off
once per incident, not once per session, and every report counts as one of its failures
(`/api/peers`)."""

from __future__ import annotations

import logging
import time

import pytest
import trio

from swarmd.dht import swarm as swarm_module
from swarmd.dht.swarm import SwarmPresence
from swarmd.errors import PeerError
from swarmd.net.peers import BanPolicy, PeerTable


class _View:
    def __init__(self) -> None:
        self.refreshes = 0

    def refresh_soon(self) -> None:
        self.refreshes += 1


def _presence() -> SwarmPresence:
    """A presence with no host: its table and its view, nothing else."""
    swarm = SwarmPresence.__new__(SwarmPresence)
    swarm.peers = PeerTable(ban_policy=BanPolicy())
    swarm._host = None
    swarm.view = _View()  # type: ignore[assignment]
    return swarm


def test_seven_sessions_reporting_one_lost_peer_ban_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    swarm = _presence()

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


def test_a_lost_peer_sits_out_once_per_incident_and_is_banned_from_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seven sessions through one lost stage report it seven times: one `sits out` line,
    seven failures, no ban (it may still connect and use this node's protocols)."""
    swarm = _presence()

    async def reports() -> None:
        for _ in range(7):
            await swarm.lose("peer-lost-midway", "stage failed (lost): no token in 4 s")

    with caplog.at_level(logging.WARNING, logger="swarmd.dht.swarm"):
        trio.run(reports)
    said = [r.getMessage() for r in caplog.records if "DIAG: peer" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("DIAG: peer sits out peer=t-midway for_s=30")
    assert swarm.view.refreshes == 1
    now = time.time()
    assert swarm.peers.bans(now) == () and swarm._not_banned("peer-lost-midway")
    assert [o.peer_id for o in swarm.peers.outs(now)] == ["peer-lost-midway"]
    lost = swarm.peers.get("peer-lost-midway")
    assert lost is not None and lost.failures == 7


def test_lost_peers_asked_back_answer_or_are_left_alone_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`answering`: each lost peer pinged once at a time; one that answers is back (its
    sit-out ends), one that does not is not pinged again for LOST_ASK_AGAIN_S (a burst
    of requests while it is down gets its 503s at once)."""
    swarm = _presence()
    swarm._unanswered = {}
    swarm._host = object()  # type: ignore[assignment]
    pinged: list[str] = []

    async def ping(host: object, peer_id: str, timeout_s: float, rounds: int = 3) -> float:
        pinged.append(peer_id)
        if peer_id != "up-again":
            raise PeerError("no answer", peer_id)
        return 0.001

    monkeypatch.setattr(swarm_module, "call_ping", ping)
    now = time.time()
    for peer in ("up-again", "still-down"):
        swarm.peers.lose(peer, "lost", now)

    def ask(peers: set[str]) -> set[str]:
        return trio.run(swarm.answering, peers)

    assert ask({"up-again", "still-down"}) == {"up-again"}
    assert sorted(pinged) == ["still-down", "up-again"]
    assert [o.peer_id for o in swarm.peers.outs(time.time())] == ["still-down"]
    pinged.clear()
    assert ask({"still-down"}) == set() and pinged == []  # asked a moment ago
    swarm._unanswered["still-down"] -= swarm_module.LOST_ASK_AGAIN_S  # time passes
    assert ask({"still-down"}) == set() and pinged == ["still-down"]
