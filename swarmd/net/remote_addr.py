"""`remote_ips`: the IP addresses a connected peer reaches this node from (trio side).

Read from libp2p's open connections (the socket's far end, not what the peer claims), for
address bans (`PeerTable.ban(..., addr=)`, `PeerTable.is_address_banned`) and for where a
dial-back may go. A connection through a circuit relay is left out: its far end is the
relay, not the peer.
"""

from __future__ import annotations

import logging
from typing import Any

from swarmd.net.host import P2PHost, libp2p_peer_id

__all__ = ["far_end", "is_relayed", "remote_ip", "remote_ips"]

log = logging.getLogger(__name__)


def remote_ips(host: P2PHost, peer_id: str) -> list[str]:
    """The IPs of the peer's open connections; [] if it has none (or is not a peer id)."""
    pid = libp2p_peer_id(peer_id)
    if pid is None:
        return []
    ips: list[str] = []
    for conn in host.libp2p.get_network().get_connections(pid):
        address = far_end(conn)
        if address is not None and address[0] not in ips:
            ips.append(address[0])
    return ips


def far_end(conn: Any) -> tuple[str, int] | None:
    """The (IP, port) of a libp2p connection's far end; None through a relay (the far end
    is the relay), or when it cannot be read."""
    if is_relayed(conn):
        return None
    try:
        address = conn.muxed_conn.get_remote_address()
    # A connection closing under us may fail in any of libp2p's layers; an address is
    # only a hint (bans, dial-backs, a punch's targets), so none is the answer then.
    except Exception as exc:
        log.debug("no remote address of a connection: %r", exc)
        return None
    return None if address is None else (str(address[0]), int(address[1]))


def is_relayed(conn: Any) -> bool:
    """Whether a libp2p connection runs through a circuit relay (its transport addresses
    are /p2p-circuit ones)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:  # a connection closing under us: not one to read an address from
        return True
    return bool(addrs) and all("/p2p-circuit" in str(a) for a in addrs)


def remote_ip(host: P2PHost, peer_id: str) -> str | None:
    ips = remote_ips(host, peer_id)
    return ips[0] if ips else None
