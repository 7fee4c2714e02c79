"""Hole punching (DCUtR): two nodes behind NAT that reach each other through a relay make
a direct connection (trio side; run by `relay.Relay`).

py-libp2p 0.8.1's `DCUtRProtocol`, measured behind real NAT routers (network namespaces
and nftables masquerade: `tests/natlab.py`) and fixed where it failed there:

- It read "our listen port" off the addresses the host advertises, which for a node
  behind NAT are its relay's circuit addresses: it told the peer to punch the relay's
  port, and bound its own dials to it. Here the port is read off the listening sockets.
- Both nodes drove a session toward each other at once; the two sessions dial the same
  pair of ports with opposite handshake roles, and the one connection the punch makes
  (a TCP simultaneous open) failed its Noise handshake. Here one side of a pair starts
  (the smaller peer id) and the other answers.
- It closed the relayed connection 60 s after an upgrade, resetting the stage streams
  still on it. Here it is left to the relay's limits; new streams take the direct
  connection (libp2p prefers a direct one).
- It answered any number of sessions and dialed every address a peer named (20): a
  peer could have this node dial addresses of its choosing again and again. Here a peer
  gets at most `MAX_SESSIONS` answered sessions per `SESSION_WINDOW_S`, one at a time,
  and at most `MAX_ADDRS` TCP addresses are punched; an address that is another
  connected peer's (the relay's, which the library's own address book lends the peer)
  is not dialed.

The punch itself is the library's: each side dials the other's public address from its
own listening port (SO_REUSEPORT), the side that answers at once and the side that
started after half the relayed round trip, so that each side's SYN leaves a NAT mapping
the other's passes through. It works where a NAT keeps a connection's source port (as
Linux's masquerade does: measured in the lab); a NAT that picks a new port for every
connection leaves the relay in use, as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import dcutr
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from multiaddr import Multiaddr

from swarmd.net.remote_addr import far_end

log = logging.getLogger(__name__)

__all__ = ["DCUTR_PROTOCOL", "HolePunch", "leads"]

MAX_SESSIONS = 3  # sessions answered for one peer per window
SESSION_WINDOW_S = 600.0
MAX_ADDRS = 4  # addresses of a peer punched in one session
MAX_PEERS_KEPT = 1024  # peers whose sessions are counted, before the old ones are dropped


def listening(host: Any) -> list[tuple[int, str, int]]:
    """The host's TCP listening sockets as (family, ip, port): where a punch dials from,
    and the port its peer is told to punch."""
    found = []
    for addr in host.get_transport_addrs():
        parsed = dcutr._tcp_ip_port(addr)
        if parsed is not None:
            found.append(parsed)
    return found


# The library's own reader of "our listen addresses" (see the module's docstring).
dcutr._local_tcp_listen_addrs = listening


def leads(me: ID, peer: ID) -> bool:
    """Whether this node starts the hole punch with `peer` (the smaller id does)."""
    return me.to_bytes() < peer.to_bytes()


class HolePunch(DCUtRProtocol):
    def __init__(self, host: IHost) -> None:
        super().__init__(host)
        self._answered: dict[ID, deque[float]] = {}  # peer -> when its sessions began
        self.punched = 0  # direct connections made
        self.failed = 0  # sessions that ended without one

    def _schedule_relay_close(self, peer_id: ID) -> None:
        """Left open (see the module's docstring)."""

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        if not leads(self.host.get_id(), peer_id):
            return await self._have_direct_connection(peer_id)
        return await super().initiate_hole_punch(peer_id)

    def may_answer(self, peer_id: ID, now: float | None = None) -> bool:
        """Whether a session `peer_id` opens is answered (and counted): one at a time,
        `MAX_SESSIONS` a window."""
        if peer_id in self._in_progress:
            return False
        now = time.monotonic() if now is None else now
        if len(self._answered) > MAX_PEERS_KEPT:  # peers that asked long ago are forgotten
            for peer, times in list(self._answered.items()):
                if not times or times[-1] <= now - SESSION_WINDOW_S:
                    del self._answered[peer]
        began = self._answered.setdefault(peer_id, deque())
        while began and began[0] <= now - SESSION_WINDOW_S:
            began.popleft()
        if len(began) >= MAX_SESSIONS:
            return False
        began.append(now)
        return True

    async def _handle_dcutr_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        if not self.may_answer(peer):
            log.info("hole punch session of %s refused: one at a time, a few a window", peer)
            await stream.reset()
            return
        await super()._handle_dcutr_stream(stream)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        kept = []
        for addr in super()._decode_observed_addrs(addr_bytes):
            if "/p2p-circuit" not in str(addr) and dcutr._tcp_ip_port(addr) is not None:
                kept.append(addr)
        return kept[:MAX_ADDRS]

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        if self._elsewhere(peer_id, addr):
            return
        await super()._dial_peer(peer_id, addr, source, as_responder)

    def _elsewhere(self, peer_id: ID, addr: Multiaddr) -> bool:
        """Whether `addr` is where this node reaches another peer (a relay's address that
        the address book lists under the peer reached through it)."""
        target = dcutr._tcp_ip_port(addr)
        if target is None:
            return False
        network = self.host.get_network()
        return any(
            far_end(conn) == target[1:]
            for other, conns in list(network.connections.items())
            if other != peer_id
            for conn in (conns if isinstance(conns, list) else [conns])
        )

    async def _perform_hole_punch(  # type: ignore[override]
        self, peer_id: ID, addrs: list[Multiaddr], as_responder: bool = False
    ) -> bool:
        punched = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        said = ",".join(str(a) for a in addrs) or "none"
        short = str(peer_id)[-8:]
        if punched:
            self.punched += 1
            log.warning("DIAG: hole punched peer=%s addrs=%s: a direct connection", short, said)
        else:
            self.failed += 1
            log.warning("DIAG: hole punch failed peer=%s addrs=%s: the relay stays", short, said)
        return punched
