"""The node's libp2p host (trio): Noise-only, yamux, framed streams, typed errors.

`open_host` builds a py-libp2p host for an `Identity` and yields a small `P2PHost`:
its full multiaddrs, `connect`, `set_handler`, `open_stream` (a `FrameStream`), and the
raw libp2p host as `.libp2p` (for the DHT). libp2p's defaults are changed where they hurt
(measured in shared/notes/libp2p.md):

- security: Noise (XX) only. A default libp2p host also accepts plaintext, TLS and SECIO.
- `max_connections_per_peer=1`: below that limit every dial waits a fixed 250 ms.
- health monitoring on: a silent peer (SIGSTOP, cable pulled) would otherwise leave reads
  hanging forever; now its connection is closed after a failed ping.
- the auto-connector is stopped: libp2p would dial peers from its peerstore (up to 150
  connections) on its own; swarmd decides whom it talks to.
- libp2p listens with SO_REUSEPORT, so a second node on the same port "succeeds" and the
  kernel splits incoming connections between the two: a fixed port is checked first.
- a cancelled write no longer breaks Noise's nonces and with them the whole connection
  (`noise_writes`).
- yamux returns read credit in batches and builds no debug line per frame unless debug
  logging is on (`yamux_tuning`): two per-frame costs of every hop of a token.
- a free lock on a frame's path (TCP stream, yamux, net stream) is taken without a trip
  through trio's scheduler (`quick_locks`): a dozen scheduler passes a frame at each end.
- limits per peer and in all: libp2p's resource manager (`libp2p.rcmgr`) caps
  connections (per peer and in total) and streams in total. Its per-peer stream limits
  are never consulted by py-libp2p 0.8.1's swarm (`acquire_scoped_stream` has no caller),
  so `set_handler` counts each peer's open inbound streams itself and resets those past
  `max_inbound_streams_per_peer`. Past its total, libp2p does not refuse a stream but
  makes it wait (a semaphore shared with outbound streams): that total is set high.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.rcmgr import ResourceLimits, ResourceManager, new_resource_manager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.utils.address_validation import expand_wildcard_address
from multiaddr import Multiaddr

from swarmd.errors import (
    ConfigError,
    DialError,
    DialTimeoutError,
    FrameError,
    IdentityError,
    SwarmError,
)
from swarmd.net import noise_writes, quick_locks, yamux_tuning
from swarmd.net.frames import DEFAULT_MAX_FRAME_BYTES, FrameStream, Traffic
from swarmd.net.identity import Identity, public_key_from_peer_id

if TYPE_CHECKING:
    from libp2p.abc import IHost, INetStream

__all__ = ["HostConfig", "P2PHost", "StreamHandler", "open_host"]

log = logging.getLogger(__name__)

noise_writes.apply()  # py-libp2p tears its Noise stream on a cancelled write
yamux_tuning.apply()  # a window update per read, a debug line per frame: per-token costs
quick_locks.apply()  # a scheduler pass for every free lock a frame takes: per-token costs

StreamHandler = Callable[[FrameStream], Awaitable[None]]

# What libp2p raises when a dial or a stream fails (its errors, and raw socket errors).
_LIBP2P_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
_CLOSE_TIMEOUT_S = 5.0  # closing the host: connections, listeners, transports


@dataclass(frozen=True)
class HostConfig:
    connect_timeout_s: float = 10.0  # TCP connect + Noise + yamux, per `connect`
    open_stream_timeout_s: float = 10.0  # new stream + protocol negotiation
    send_timeout_s: float = 10.0  # one frame written (a peer that stops reading)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # per frame, both directions
    dial_retries: int = 1  # libp2p's redials of a failed address (its default: 3)
    health_check_interval_s: float = 5.0  # libp2p pings every connection this often
    health_ping_timeout_s: float = 5.0  # a ping slower than this closes the connection
    max_inbound_streams_per_peer: int = 256  # swarmd streams one peer holds open to us
    max_streams: int = 8192  # every stream, both directions, all peers (libp2p's rcmgr)
    max_connections: int = 512  # connections in all (libp2p's rcmgr)
    max_connections_per_peer: int = 4  # established connections to one peer (libp2p's rcmgr)


@dataclass
class Advertised:
    """What this host tells peers to dial (identify, provider records, swarmd's records):
    the circuit addresses of a relay holding a slot for it, else the announced addresses
    (`--announce-addr`), else where it listens."""

    announce: list[Multiaddr] = field(default_factory=list)
    relayed: list[Multiaddr] = field(default_factory=list)  # set once a relay holds a slot

    def choose(self, listening: list[Multiaddr]) -> list[Multiaddr]:
        """libp2p's address factory: called with the listen addresses it would tell."""
        return list(self.relayed or self.announce or listening)


class P2PHost:
    """A running libp2p host, as swarmd uses it. Made by `open_host`."""

    def __init__(
        self,
        libp2p_host: IHost,
        identity: Identity,
        config: HostConfig,
        advertised: Advertised | None = None,
    ) -> None:
        self._host = libp2p_host
        self._config = config
        self._advertised = advertised or Advertised()
        # Set by the owner: how to reach a /p2p-circuit address (libp2p's dialer skips them).
        self.circuit_dialer: Callable[[str, float], Awaitable[None]] | None = None
        self.peer_id = identity.peer_id
        self.short_id = identity.short_id
        # Set by the owner of the host: who may open swarmd streams, and what to do with a
        # peer that sent garbage.
        self.admits: Callable[[str], bool] | None = None
        self.misbehaved: Callable[[str, str], Awaitable[None]] | None = None
        self.traffic = Traffic()  # bytes per protocol over swarmd's frame streams
        self._inbound: dict[str, int] = {}  # peer -> its open inbound swarmd streams

    @property
    def libp2p(self) -> IHost:
        """The py-libp2p host itself (to attach a DHT)."""
        return self._host

    @property
    def relayed(self) -> list[str]:
        """The circuit addresses (no /p2p/ of this node) it is reachable at, through a relay
        (a node that takes no inbound connection); told to peers by identify too."""
        return [str(a) for a in self._advertised.relayed]

    @relayed.setter
    def relayed(self, addrs: list[str]) -> None:
        self._advertised.relayed = [Multiaddr(a) for a in addrs]

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs others can connect to: /ip4/IP/tcp/PORT/p2p/PEER_ID.

        A wildcard listen address (0.0.0.0, ::) is replaced by this machine's interfaces.
        """
        return [
            f"{addr}/p2p/{self.peer_id}"
            for listen_addr in self._host.get_transport_addrs()
            for addr in expand_wildcard_address(listen_addr)
        ]

    @property
    def announced(self) -> list[str]:
        """The full multiaddrs peers are told to dial (records): the circuit addresses of a
        node that accepts no inbound connections, else the announced ones when the node was
        given any (`--announce-addr`, also told by identify), else `addrs`."""
        if self._advertised.relayed:
            return [f"{addr}/p2p/{self.peer_id}" for addr in self._advertised.relayed]
        return self.direct

    @property
    def direct(self) -> list[str]:
        """The full direct multiaddrs of this node, relay or not: the announced ones when
        it was given any, else `addrs` (what a dial-back check asks peers to dial)."""
        if self._advertised.announce:
            return [f"{addr}/p2p/{self.peer_id}" for addr in self._advertised.announce]
        return self.addrs

    @property
    def port(self) -> int:
        """The TCP port it listens on (the real one when 0 was asked for)."""
        for addr in self._host.get_transport_addrs():
            return int(addr.value_for_protocol("tcp"))
        raise ConfigError("the libp2p host is not listening")

    def inbound_streams(self, peer_id: str) -> int:
        """The swarmd streams `peer_id` holds open to this host now (capped per peer)."""
        return self._inbound.get(peer_id, 0)

    def connected_peers(self) -> list[str]:
        return [str(pid) for pid in self._host.get_connected_peers()]

    def peer_addrs(self, peer_id: str) -> list[str]:
        """The full TCP multiaddrs a peer listens on, as identify told this host (none
        while it is unknown)."""
        pid = libp2p_peer_id(peer_id)
        if pid is None:
            return []
        try:
            addrs = self._host.get_peerstore().addrs(pid)
        except PeerStoreError:
            return []
        full = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in map(str, addrs)]
        return [
            a
            for a in full
            if "/tcp/" in a and a.endswith(f"/p2p/{peer_id}") and "/p2p-circuit" not in a
        ]

    async def connect(self, multiaddr: str, timeout_s: float | None = None) -> str:
        """Connect to a full multiaddr (with /p2p/PEER_ID); return the peer id.

        An explicit connect is tried even if the peer failed recently (libp2p otherwise
        refuses redials for 60 s). Noise proves the peer holds the key of that peer id. A
        `/p2p-circuit` address goes through the relay it names (`circuit_dialer`).
        """
        info = _peer_info(multiaddr)
        peer_id = str(info.peer_id)
        if peer_id == self.peer_id:
            raise DialError(f"'{multiaddr}' is this node itself", peer_id)
        timeout = self._config.connect_timeout_s if timeout_s is None else timeout_s
        if "/p2p-circuit" in multiaddr:
            if self.circuit_dialer is None:
                raise DialError(f"'{multiaddr}' needs a relay and none is running", peer_id)
            await self.circuit_dialer(multiaddr, timeout)
            return peer_id
        self._host.get_network().unblock_peer(info.peer_id)
        try:
            with trio.fail_after(timeout):
                await self._host.connect(info)
        except trio.TooSlowError:
            raise DialTimeoutError(
                f"connecting to {multiaddr} took more than {timeout:g} s", peer_id
            ) from None
        except _LIBP2P_ERRORS as exc:
            raise DialError(f"cannot connect to {multiaddr}: {_reason(exc)}", peer_id) from exc
        return peer_id

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to a peer (its streams end with errors)."""
        try:
            await self._host.disconnect(_parse_peer_id(peer_id))
        except _LIBP2P_ERRORS as exc:
            log.debug("disconnect from %s: %s", peer_id[-8:], _reason(exc))

    def set_handler(self, protocol: str, handler: StreamHandler, gated: bool = True) -> None:
        """Serve `protocol`: each incoming stream runs `handler(FrameStream)`.

        A `gated` protocol first asks `admits(peer_id)` and resets the stream of a peer it
        refuses; a bad frame reports the peer to `misbehaved` (which bans it).

        The stream is closed when the handler returns and reset when it raises. A handler
        that raises never disturbs the connection: SwarmErrors (a peer's bad frame, a
        timeout) are logged at debug level, anything else with its traceback.
        """

        async def on_stream(stream: INetStream) -> None:
            framed = self._frame_stream(stream)
            peer = framed.peer_id
            if self._inbound.get(peer, 0) >= self._config.max_inbound_streams_per_peer:
                log.debug("%s stream from %s reset: its stream cap", protocol, peer[-8:])
                await framed.reset()
                return
            self._inbound[peer] = self._inbound.get(peer, 0) + 1
            try:
                await serve(framed)
            finally:
                left = self._inbound.pop(peer) - 1
                if left:
                    self._inbound[peer] = left

        async def serve(framed: FrameStream) -> None:
            if gated and self.admits is not None and not self.admits(framed.peer_id):
                await framed.reset()  # banned, or not yet proven in a private swarm
                return
            done = False
            try:
                await handler(framed)
                done = True
            except FrameError as exc:
                # Garbage on the wire is hostile or broken: the peer is banned (DESIGN 2).
                log.warning(
                    "DIAG: bad frame peer=%s protocol=%s: %s", framed.peer_id[-8:], protocol, exc
                )
                if self.misbehaved is not None:
                    await self.misbehaved(framed.peer_id, f"bad frame on {protocol}: {exc}")
            except SwarmError as exc:
                log.debug("%s stream from %s failed: %s", protocol, framed.peer_id[-8:], exc)
            except Exception:
                log.exception("handler of %s failed (peer %s)", protocol, framed.peer_id[-8:])
            finally:
                if done:
                    await framed.close()
                else:
                    await framed.reset()

        self._host.set_stream_handler(TProtocol(protocol), on_stream)

    async def open_stream(
        self, peer_id: str, protocol: str, timeout_s: float | None = None
    ) -> FrameStream:
        """A new stream to a peer on `protocol` (dials the peer if needed)."""
        pid = _parse_peer_id(peer_id)
        timeout = self._config.open_stream_timeout_s if timeout_s is None else timeout_s
        try:
            with trio.fail_after(timeout):
                stream = await self._host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise DialTimeoutError(
                f"opening a {protocol} stream to peer {peer_id[-8:]} took more than {timeout:g} s",
                peer_id,
            ) from None
        except _LIBP2P_ERRORS as exc:
            raise DialError(
                f"cannot open a {protocol} stream to peer {peer_id[-8:]}: {_reason(exc)}",
                peer_id,
            ) from exc
        return self._frame_stream(stream)

    def _frame_stream(self, stream: INetStream) -> FrameStream:
        return FrameStream(
            stream,
            max_frame_bytes=self._config.max_frame_bytes,
            send_timeout_s=self._config.send_timeout_s,
            traffic=self.traffic,
        )

    def __repr__(self) -> str:
        return f"P2PHost(peer_id={self.peer_id!r}, addrs={self.addrs!r})"


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen_port: int,
    host_ip: str = "127.0.0.1",
    config: HostConfig | None = None,
    announce: tuple[str, ...] = (),
    listen: bool = True,
) -> AsyncIterator[P2PHost]:
    """Run a libp2p host listening on host_ip:listen_port (0: any free port).

    `announce`: multiaddrs (no /p2p/ part) peers must dial instead of the listen address,
    told to them by identify too; `listen=False`: a host that takes no inbound connection
    (it dials out; peers reach it through a relay). Everything it opened is closed when the
    block exits. Raises ConfigError for a bad address or a port in use, IdentityError if
    libp2p derives another peer id.
    """
    config = config or HostConfig()
    listen_addr = _listen_multiaddr(host_ip, listen_port) if listen else None
    advertised = Advertised(announce=[_announce_multiaddr(addr) for addr in announce])
    if listen:
        _check_can_listen(host_ip, listen_port)
    libp2p_host = _new_libp2p_host(identity, config, advertised)
    if str(libp2p_host.get_id()) != identity.peer_id:
        raise IdentityError(
            f"libp2p derives peer id {libp2p_host.get_id()} from this node's key, "
            f"expected {identity.peer_id}"
        )
    run = _Libp2pRun(libp2p_host, listen_addr)
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run.run)
        try:
            await run.started.wait()
            if listen_addr is not None and not run.listening:
                raise ConfigError(f"cannot listen on {listen_addr} (see the libp2p log)")
            host = P2PHost(libp2p_host, identity, config, advertised)
            where = ", ".join(host.addrs) or "nothing (no inbound connections)"
            log.info("libp2p host %s listening on %s", identity.short_id, where)
            yield host
        except Exception as exc:
            # Carried past the nursery, so the caller gets it as it is, not in a group.
            body_error = exc
        finally:
            run.stop.set()
    if body_error is not None:
        raise body_error


class _Libp2pRun:
    """libp2p's `run`, shielded from the caller's cancellation, until `stop`.

    libp2p's tasks are not safe to cancel at any point: cancelling the block would cancel
    them mid-cleanup and leak sockets (a connection marked closed whose socket never
    is). So they run shielded; `stop` closes every connection, then the host, with
    nothing cancelled; only if that hangs past a deadline is libp2p cancelled.
    (Not `nursery.start`: in a cancelled scope it would wait for the shielded task.)
    """

    def __init__(self, libp2p_host: IHost, listen_addr: Multiaddr | None) -> None:
        self.libp2p_host = libp2p_host
        self.listen_addrs = [] if listen_addr is None else [listen_addr]
        self.started = trio.Event()
        self.stop = trio.Event()
        self.listening = False

    async def run(self) -> None:
        with trio.CancelScope(shield=True) as scope:
            try:
                async with self.libp2p_host.run(self.listen_addrs):
                    await self.libp2p_host.get_network().auto_connector.stop()  # swarmd picks
                    self.listening = bool(self.libp2p_host.get_transport_addrs())
                    self.started.set()
                    await self.stop.wait()
                    scope.deadline = trio.current_time() + 2 * _CLOSE_TIMEOUT_S
                    await _close_libp2p_host(self.libp2p_host)
            finally:
                self.started.set()


async def _close_libp2p_host(libp2p_host: IHost) -> None:
    """Close every connection (in parallel: libp2p's yamux close sleeps 100 ms), then the
    host itself (listeners, transports)."""

    async def close_quietly(close: Callable[[], Awaitable[None]]) -> None:
        try:
            await close()
        except _LIBP2P_ERRORS as exc:
            log.debug("closing libp2p: %s", _reason(exc))

    with trio.move_on_after(_CLOSE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for conns in list(libp2p_host.get_network().connections.values()):
                for conn in list(conns):
                    nursery.start_soon(close_quietly, conn.close)
        await close_quietly(libp2p_host.close)


def _new_libp2p_host(
    identity: Identity, config: HostConfig, advertised: Advertised | None = None
) -> IHost:
    key_pair = create_new_key_pair(seed=identity.private_seed)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    connection_config = ConnectionConfig(
        max_connections_per_peer=1,  # at the limit a dial skips the fixed 250 ms wait
        dial_timeout=config.connect_timeout_s,
        enable_health_monitoring=True,
        health_initial_delay=config.health_check_interval_s,
        health_warmup_window=config.health_check_interval_s,  # libp2p's default: 5 s
        health_check_interval=config.health_check_interval_s,
        ping_timeout=config.health_ping_timeout_s,
        abort_connection_on_ping_failure=True,
    )
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},  # Noise only: the default adds plaintext
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        connection_config=connection_config,
        resource_manager=_resource_manager(config),
        # What identify (and the DHT's provider records) tell peers to dial.
        addrs_factory=(advertised or Advertised()).choose,
    )
    # new_host takes no retry config; the swarm reads this attribute on every dial.
    host.get_network().retry_config = RetryConfig(max_retries=config.dial_retries)
    return host


def _resource_manager(config: HostConfig) -> ResourceManager:
    """libp2p's limits: connections per peer and in all, streams in all."""
    total = config.max_connections
    return new_resource_manager(
        limits=ResourceLimits(max_connections=total, max_streams=config.max_streams),
        connection_limits=ConnectionLimits(
            max_pending_inbound=min(64, total),
            max_pending_outbound=min(64, total),
            max_established_inbound=total,
            max_established_outbound=total,
            max_established_per_peer=config.max_connections_per_peer,
            max_established_total=total,
        ),
    )


def _listen_multiaddr(host_ip: str, port: int) -> Multiaddr:
    try:
        ip = ipaddress.ip_address(host_ip)
    except ValueError:
        raise ConfigError(f"the p2p listen host must be an IP address, got {host_ip!r}") from None
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"the p2p port must be in 0..65535, got {port!r}")
    return Multiaddr(f"/ip{ip.version}/{ip}/tcp/{port}")


def _announce_multiaddr(text: str) -> Multiaddr:
    """An address to announce: a multiaddr over TCP, without a peer id."""
    try:
        addr = Multiaddr(text)
    except ValueError as exc:
        raise ConfigError(f"announce address {text!r} is not a multiaddr: {exc}") from exc
    protocols = [p.name for p in addr.protocols()]
    if "p2p" in protocols or "tcp" not in protocols:
        raise ConfigError(
            f"announce address {text!r} must be a TCP multiaddr without /p2p/, like "
            "/ip4/203.0.113.7/tcp/8810 (the node appends its own id)"
        )
    return addr


def _check_can_listen(host_ip: str, port: int) -> None:
    """Refuse an address libp2p would fail on quietly, or share with another process.

    libp2p only logs a failed listen, and listens with SO_REUSEPORT: a second node on a
    busy port would start and the kernel would split incoming connections between them.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(host_ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        try:
            probe.bind((host_ip, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"the p2p port {port} on {host_ip} is already in use; "
                    "choose another with --p2p-port (0 picks a free one)"
                ) from exc
            raise ConfigError(f"cannot listen on {host_ip}:{port}: {exc}") from exc


def check_peer_addr(multiaddr: str) -> str:
    """The peer id of a full multiaddr (/ip4/…/tcp/…/p2p/PEER_ID); DialError otherwise."""
    return str(_peer_info(multiaddr).peer_id)


def _peer_info(multiaddr: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(Multiaddr(multiaddr))
    except ValueError as exc:
        raise DialError(f"'{multiaddr}' is not a multiaddr with a /p2p/ peer id: {exc}") from exc


def libp2p_peer_id(peer_id: str) -> ID | None:
    """libp2p's ID for an Ed25519 peer id string; None for anything else.

    `ID.from_base58` alone accepts any base58 text, so the key inside is checked first.
    """
    if public_key_from_peer_id(peer_id) is None:
        return None
    try:
        return ID.from_base58(peer_id)
    except ValueError:
        return None


def _parse_peer_id(peer_id: str) -> ID:
    pid = libp2p_peer_id(peer_id)
    if pid is None:
        raise DialError(f"{peer_id!r} is not an Ed25519 peer id")
    return pid


def _reason(exc: BaseException) -> str:
    """The innermost message of a libp2p error chain (the outer ones say "dial failed")."""
    reason = str(exc) or type(exc).__name__
    current: BaseException | None = exc
    for _ in range(6):
        current = current.__cause__ or current.__context__ if current else None
        if current is None:
            break
        if str(current):
            reason = str(current)
    return reason
