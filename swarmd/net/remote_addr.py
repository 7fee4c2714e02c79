"""`remote_ips`: the IP addresses a connected peer reaches this node from (trio side).

Read from libp2p's open connections (the socket's far end, not what the peer claims), for
address bans (`PeerTable.ban(..., addr=)`, `PeerTable.is_address_banned`).
"""

from __future__ import annotations

import logging

from swarmd.net.host import P2PHost, libp2p_peer_id

__all__ = ["remote_ip", "remote_ips"]

log = logging.getLogger(__name__)


def remote_ips(host: P2PHost, peer_id: str) -> list[str]:
    """The IPs of the peer's open connections; [] if it has none (or is not a peer id)."""
    pid = libp2p_peer_id(peer_id)
    if pid is None:
        return []
    ips: list[str] = []
    try:
        for conn in host.libp2p.get_network().get_connections(pid):
            address = conn.muxed_conn.get_remote_address()
            if address is not None and address[0] not in ips:
                ips.append(address[0])
    # A connection closing under us may fail in any of libp2p's layers; an address is
    # only a hint for bans, so none is the answer then.
    except Exception as exc:
        log.debug("no remote address of %s: %r", peer_id[-8:], exc)
    return ips


def remote_ip(host: P2PHost, peer_id: str) -> str | None:
    ips = remote_ips(host, peer_id)
    return ips[0] if ips else None
