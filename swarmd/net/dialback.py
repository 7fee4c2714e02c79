"""Is this node reachable? Peers dial it back (trio side): swarmd's own AutoNAT.

A node that listens may still be unreachable: behind a home router's NAT, or a firewall,
peers cannot open a connection to the address it tells them. It cannot see that from
inside, so it asks connected peers (`call_dial_back`) to dial its direct addresses with a
fresh connection. A peer answers (`DialBackService`) by dialing each address on a new TCP
connection through Noise, which proves the node at the far end holds the caller's key,
then closing it. py-libp2p's AutoNAT v1 cannot be used: its dial-back reuses the
connection the question came on, so a closed port still answers "public".

The answering side must not become a way to scan or flood third parties, so it dials only
addresses on the IP the caller's own connection comes from (plus that IP with each port
the caller names: a router that forwards the same port), at most four, each within a few
seconds; one question per caller a minute, a few at a time. A caller that asks for more
gets "refused", never a ban: asking is not misbehaviour.

On the wire (`/swarmd/rpc/1`, method "dial_back"):

    args    {"addrs": [multiaddr, ...]}  (/ip4|ip6/IP/tcp/PORT, optionally /p2p/<caller>)
    result  {"reached": [multiaddr, ...], "tried": int}
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from swarmd.errors import (
    InvalidRequestError,
    MalformedFrameError,
    OverloadedError,
    SwarmError,
)
from swarmd.net.host import P2PHost
from swarmd.net.remote_addr import remote_ips
from swarmd.net.rpc import RpcService, call
from swarmd.net.safe_text import safe_text

__all__ = [
    "COOLDOWN_S",
    "DIAL_BACK_METHOD",
    "DialBackService",
    "Verdict",
    "call_dial_back",
    "dial_fresh",
    "direct_tcp",
    "judge",
]

log = logging.getLogger(__name__)

DIAL_BACK_METHOD = "dial_back"
MAX_ADDRS = 4  # addresses one question may name, and dials one answer makes
MAX_ADDR_CHARS = 256
DIAL_TIMEOUT_S = 5.0  # one dial, TCP and Noise; a NAT drops the SYN: this is the wait
CALL_TIMEOUT_S = DIAL_TIMEOUT_S + 5.0
COOLDOWN_S = 60.0  # one question per caller in this long
MAX_AT_ONCE = 4  # questions answered at once (each makes up to MAX_ADDRS dials)
_PROTECT_TAG = "swarmd-dial-back"  # the asked peers' connections are not trimmed meanwhile
_SETTLE_S = 5.0  # the longest a dial-back's own connection takes to go, after the answer
_POLL_S = 0.02  # how often the connections are looked at meanwhile


def direct_tcp(addr: str) -> tuple[str, int] | None:
    """(ip, port) of a /ip4|ip6/IP/tcp/PORT[/p2p/ID] address; None for anything else
    (DNS names, circuits, other transports)."""
    try:
        maddr = Multiaddr(addr)
        protocols = [p.name for p in maddr.protocols()]
    except Exception:  # a peer's text: any parse failure means "not an address"
        return None
    if protocols[:2] not in (["ip4", "tcp"], ["ip6", "tcp"]) or protocols[2:] not in ([], ["p2p"]):
        return None
    ip = maddr.value_for_protocol(protocols[0])
    port = int(maddr.value_for_protocol("tcp"))
    return (str(ip), port) if 0 < port < 65536 else None


def _tcp_multiaddr(ip: str, port: int) -> str:
    family = "ip6" if ipaddress.ip_address(ip).version == 6 else "ip4"
    return f"/{family}/{ip}/tcp/{port}"


async def dial_fresh(host: P2PHost, addr: str, peer_id: str, timeout_s: float) -> bool:
    """Whether `peer_id` answers at `addr` (/ipX/IP/tcp/PORT) on a new connection: TCP,
    Noise (which proves the key), yamux; then closed. It never joins the host's
    connections, so an open connection to that peer cannot answer for the address."""
    network = host.libp2p.get_network()
    maddr = Multiaddr(addr)
    transport = network.transport_manager.transport_for_dialing(maddr)
    if transport is None:
        return False
    with trio.move_on_after(timeout_s):
        try:
            raw = await transport.dial(maddr)
        except Exception as exc:  # refused, unroutable: libp2p's errors have no common base
            log.debug("dial-back to %s failed: %s", addr, safe_text(exc))
            return False
        try:
            expected = ID.from_base58(peer_id)
            secured = await network.upgrader.upgrade_security(raw, True, expected)
            # The muxer too, so the far end sees a whole connection open and close rather
            # than logging a failed upgrade.
            muxed = await network.upgrader.upgrade_connection(secured, expected)
            await muxed.close()
            return True
        except Exception as exc:  # another key at that address, or a broken handshake
            log.debug("dial-back to %s failed its handshake: %s", addr, safe_text(exc))
            return False
        finally:
            with trio.CancelScope(shield=True):
                await raw.close()
    return False


@dataclass
class DialBackService:
    """The answering side, registered on a node's RPC service."""

    host: P2PHost
    timeout_s: float = DIAL_TIMEOUT_S
    cooldown_s: float = COOLDOWN_S

    def __post_init__(self) -> None:
        self._last: dict[str, float] = {}  # caller -> when it last asked

    def register(self, rpc: RpcService) -> None:
        rpc.register(
            DIAL_BACK_METHOD,
            self.rpc_dial_back,
            max_concurrency=MAX_AT_ONCE,
            timeout_s=self.timeout_s + 2.0,
        )

    async def rpc_dial_back(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        addrs = args.get("addrs")
        if (
            not isinstance(addrs, list)
            or not 0 < len(addrs) <= MAX_ADDRS
            or not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs)
        ):
            raise InvalidRequestError(f"'addrs' is a list of 1 to {MAX_ADDRS} multiaddrs")
        now = time.monotonic()
        self._last = {p: t for p, t in self._last.items() if now - t < self.cooldown_s}
        if peer_id in self._last:
            raise OverloadedError(
                f"one dial-back question a peer every {self.cooldown_s:g} s",
                int(self.cooldown_s),
            )
        self._last[peer_id] = now
        targets = self._targets(peer_id, addrs)
        reached: list[str] = []

        async def dial(target: str) -> None:
            if await dial_fresh(self.host, target, peer_id, self.timeout_s):
                reached.append(target)

        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(dial, target)
        return {"reached": sorted(reached), "tried": len(targets)}

    def _targets(self, peer_id: str, addrs: list[str]) -> list[str]:
        """What to dial: the named addresses on an IP the caller comes from, then that IP
        with the ports named; at most MAX_ADDRS, never another machine."""
        observed = remote_ips(self.host, peer_id)
        named = [parsed for a in addrs if (parsed := direct_tcp(a)) is not None]
        candidates = [(ip, port) for ip, port in named if ip in observed]
        candidates += [(ip, port) for ip in observed for _, port in named]
        targets = dict.fromkeys(_tcp_multiaddr(ip, port) for ip, port in candidates)
        return list(targets)[:MAX_ADDRS]


class _Arrivals:
    """A libp2p notifee: the peers whose connections were registered while it listened
    (libp2p tells it after any trim, so the protection must outlast this)."""

    def __init__(self) -> None:
        self.peers: set[ID] = set()

    async def connected(self, network: Any, conn: Any) -> None:
        self.peers.add(conn.muxed_conn.peer_id)

    async def disconnected(self, network: Any, conn: Any) -> None: ...

    async def opened_stream(self, network: Any, stream: Any) -> None: ...

    async def closed_stream(self, network: Any, stream: Any) -> None: ...

    async def listen(self, network: Any, multiaddr: Any) -> None: ...

    async def listen_close(self, network: Any, multiaddr: Any) -> None: ...


async def _until_gone(network: Any, arrivals: _Arrivals, peers: list[ID]) -> None:
    """Until each of `peers`' dial-back connection has been registered here and is gone
    again (one connection left), or _SETTLE_S."""
    for _ in range(int(_SETTLE_S / _POLL_S)):
        if all(p in arrivals.peers and len(network.connections.get(p, ())) <= 1 for p in peers):
            return
        await trio.sleep(_POLL_S)


@dataclass(frozen=True)
class Verdict:
    """What the peers asked found: "public" (one reached this node), "private" (every
    answer dialed and none reached it) or "unknown" (no answer that dialed anything)."""

    reachability: str
    reached: tuple[str, ...] = ()  # the addresses peers reached
    asked: int = 0  # peers that answered with a dial
    detail: str = ""


async def call_dial_back(host: P2PHost, peer_id: str, addrs: list[str]) -> dict[str, Any]:
    """Ask `peer_id` to dial this node back at `addrs`; its answer, checked."""
    result = await call(host, peer_id, DIAL_BACK_METHOD, {"addrs": addrs}, CALL_TIMEOUT_S)
    reached, tried = result.get("reached"), result.get("tried")
    if not isinstance(reached, list) or not isinstance(tried, int) or isinstance(tried, bool):
        raise MalformedFrameError("a dial-back answer is {'reached': [str], 'tried': int}", peer_id)
    return {"reached": [a for a in reached if isinstance(a, str)][:MAX_ADDRS], "tried": tried}


async def judge(host: P2PHost, peers: list[str], addrs: list[str]) -> Verdict:
    """Ask `peers` (all at once) to dial this node back at `addrs` and weigh the answers.

    One peer that reached it is enough for "public"; "private" needs every answer that
    dialed to have failed. A peer could lie either way; a false "public" leaves the node
    as it was before any check, a false "private" would send its traffic through a
    relay, so a single "reached" wins. A peer that cannot answer (an older swarmd, busy,
    gone) counts for nothing.
    """
    if not addrs:
        return Verdict("unknown", detail="no direct address to check")
    # A wildcard listener has one address per interface, all on one port: the first few
    # are enough, since a peer also tries the IP it sees with each port named.
    addrs = addrs[:MAX_ADDRS]
    answers: list[dict[str, Any]] = []
    reached_by: list[ID] = []  # peers whose dial-back connection came (or is coming) here
    failures: list[str] = []

    async def ask(peer_id: str) -> None:
        try:
            answer = await call_dial_back(host, peer_id, addrs)
            answers.append(answer)
            if answer["reached"]:
                reached_by.append(ID.from_base58(peer_id))
        except SwarmError as exc:  # RemoteError, RpcTimeoutError, a malformed answer
            failures.append(f"{peer_id[-8:]}: {safe_text(exc, 200)}")

    # The dial-back arrives here as a second connection from each asked peer. libp2p
    # keeps one connection a peer (host.py) and trims the surplus, never one younger than
    # its grace period: it closed the old one, with every session and stream on it (the
    # stages were lost and banned at a swarm's first re-check, ten minutes in). While
    # asked, the peers are protected from trimming; the dial-back's connection closes by
    # itself once its handshake is done.
    network = host.libp2p.get_network()
    protected = [ID.from_base58(p) for p in peers]
    arrivals = _Arrivals()
    network.register_notifee(arrivals)
    for peer in protected:
        network.protect(peer, _PROTECT_TAG)
    try:
        async with trio.open_nursery() as nursery:
            for peer_id in peers:
                nursery.start_soon(ask, peer_id)
        # The answer can come before this side has registered the dial-back's connection
        # (and would trim): each peer that reached this node stays protected until its
        # second connection has been seen and is gone again, or for _SETTLE_S at most.
        await _until_gone(network, arrivals, reached_by)
    finally:
        network.remove_notifee(arrivals)
        for peer in protected:
            network.unprotect(peer, _PROTECT_TAG)
    dialed = [a for a in answers if a["tried"] > 0]
    reached = tuple(sorted({addr for a in dialed for addr in a["reached"]}))
    if reached:
        return Verdict("public", reached, len(dialed))
    if dialed:
        return Verdict("private", (), len(dialed))
    return Verdict("unknown", (), 0, "; ".join(failures) or "no peer could dial back")
