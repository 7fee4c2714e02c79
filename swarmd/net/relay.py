"""Circuit relay v2: reaching a node that accepts no inbound connections (trio side).

py-libp2p 0.8.1's `relay.circuit_v2`, as swarmd uses it (measured in a probe of the
library first; its report is quoted in the closing note of issue 17):

- **Every node** can dial a `/p2p-circuit` address (`Relay.dial`): libp2p's own dialer
  skips them, so `P2PHost.connect` hands them here. The connection through the relay is
  upgraded like a TCP one, Noise XX and yamux end to end: the relay forwards ciphertext
  and cannot pose as the peer. Every node also takes circuits in (the STOP protocol).
- **A relay** (`--relay-service`) serves the HOP protocol, with limits: reservations in
  all, circuits per reserved peer, each circuit's duration and bytes. Two of the
  library's bugs are fixed here: a circuit that ends closed every other circuit to the
  same peer (its bookkeeping is keyed by peer id), and a peer that left kept its
  reservation slot for the reservation's whole lifetime.
- **A node that accepts no inbound connections** (`--no-listen`) reserves a slot on a
  relay among its connected peers (those whose identify lists the HOP protocol) and
  announces `<relay>/p2p-circuit/p2p/<itself>`; the library renews the reservation.
- HOP and STOP streams pass this node's gate (`admits`): a banned peer, or one that has
  not proved a private swarm's key, is refused like on swarmd's own protocols.

- **Hole punching** (DCUtR, `swarmd/net/punch.py`): two nodes connected through a relay
  make a direct connection by dialing each other at once from their listening ports;
  its stream passes the same gate.

A node that is reached through a relay but dials out itself (to a reachable peer) gives
that peer a direct connection all the same, and streams between the two take it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStoreError
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits, RelayResourceManager
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from swarmd.errors import DialError, DialTimeoutError
from swarmd.net.host import libp2p_peer_id
from swarmd.net.punch import DCUTR_PROTOCOL, HolePunch
from swarmd.net.remote_addr import is_relayed

log = logging.getLogger(__name__)

__all__ = ["HOP_PROTOCOL", "Relay", "RelaySettings", "is_circuit"]

_CLOSE_TIMEOUT_S = 2.0
# What the library raises when a circuit cannot be made: bare ConnectionErrors (OSError),
# its own errors, broken streams.
_RELAY_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


def is_circuit(multiaddr: str) -> bool:
    """Whether an address reaches its peer through a relay."""
    return "/p2p-circuit" in multiaddr


@dataclass(frozen=True)
class RelaySettings:
    serve: bool = False  # run the HOP service for others (--relay-service)
    max_reservations: int = 32  # peers holding a slot here at once
    max_circuits_per_peer: int = 8  # circuits to one reserved peer at once
    circuit_duration_s: int = 3600  # one circuit's life (0: unlimited)
    circuit_mb: int = 1024  # one circuit's bytes, both ways (0: unlimited)
    reservation_ttl_s: int = 3600  # a reservation's life (its holder renews it)

    def limits(self) -> RelayLimits:
        return RelayLimits(
            duration=self.circuit_duration_s,
            data=self.circuit_mb * 1024 * 1024,
            max_circuit_conns=self.max_circuits_per_peer,
            max_reservations=self.max_reservations,
            reservation_ttl=self.reservation_ttl_s,
        )


class _PrunedReservations(RelayResourceManager):
    """Reservations of peers that have left give their slots back at once (the library
    keeps them until they expire, an hour by default: a few peers that reserve and leave
    would lock everyone else out)."""

    def _clean_expired(self) -> None:
        super()._clean_expired()
        for peer_id in [p for p in self._reservations if not self._is_peer_connected(p)]:
            del self._reservations[peer_id]


# Never a key of the library's `_active_relays`: its own clean-up finds nothing to close.
_NO_PEER = ID(b"\x00\x06swarmd")


class _PerCircuitRelay(CircuitV2Protocol):
    """The library's relay, each circuit cleaned up on its own (the library closes the
    streams of the *latest* circuit to a peer when any circuit to it ends: one dialer
    leaving would cut every other dialer's connection to that peer)."""

    def __init__(self, host: IHost, limits: RelayLimits, allow_hop: bool) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self.resource_manager = _PrunedReservations(self.limits, self.host)

    async def _relay_data(  # type: ignore[override]
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: int | None = None,
    ) -> None:
        try:
            await super()._relay_data(
                src_stream, dst_stream, _NO_PEER, deadline, circuit_data_limit
            )
        finally:  # one direction ended (EOF, reset, a limit): end this circuit, only it
            await self._close_stream(src_stream)
            await self._close_stream(dst_stream)
            mine = (src_stream, dst_stream)
            for key, (s, d) in list(self._active_relays.items()):
                if s in mine or d in mine:
                    del self._active_relays[key]


# How the library logs a circuit or a reservation's stream ending as it should (the other
# side closed or reset it), at ERROR: "...: " with no reason, or the reset/closed text.
_ENDING_MESSAGES = (
    "Error reading from hop stream from ",
    "Unexpected error reading from stream: ",
    "Error writing to destination stream: ",
)
_ENDING_REASONS = ("", "Cannot read from stream; stream is reset", "stream is reset")


class _CircuitEndings(logging.Filter):
    """The library's ERROR lines for streams that simply ended, made DEBUG lines (a relay
    printed one after every reservation and every circuit's end). Other errors stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and is_circuit_ending(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def is_circuit_ending(message: str) -> bool:
    for start in _ENDING_MESSAGES:
        if message.startswith(start):
            reason = message[len(start) :]
            if start.endswith("from "):  # "<peer id>: <reason>"
                reason = reason.partition(": ")[2] if ": " in reason else reason
            return reason.strip() in _ENDING_REASONS
    return False


def quiet_circuit_endings() -> None:
    """Install `_CircuitEndings` on the library's relay logger (once)."""
    relay_logger = logging.getLogger("libp2p.relay.circuit_v2.protocol")
    if not any(isinstance(f, _CircuitEndings) for f in relay_logger.filters):
        relay_logger.addFilter(_CircuitEndings())


class Relay:
    """This node's part in circuit relay v2; `run` it for as long as the host runs."""

    def __init__(self, host: IHost, settings: RelaySettings, admits: Callable[[str], bool]):
        quiet_circuit_endings()
        self._host = host
        self.settings = settings
        self._admits = admits
        self._protocol = _PerCircuitRelay(host, settings.limits(), allow_hop=settings.serve)
        # STOP: circuits come in. CLIENT only for reserving: a dialing CLIENT would first
        # reserve a slot for itself on the relay it dials through (a wasted slot).
        roles = RelayRole.STOP | RelayRole.CLIENT
        self._transport = CircuitV2Transport(host, self._protocol, RelayConfig(roles=roles))
        self._dialer = CircuitV2Transport(host, self._protocol, RelayConfig(roles=RelayRole.STOP))
        self.punch = HolePunch(host)
        self._nursery: trio.Nursery | None = None
        self.reserved_on: str | None = None  # the relay's peer id, while a slot is held

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with (
            background_trio_service(self._protocol),
            background_trio_service(self.punch),
            trio.open_nursery() as nursery,
        ):
            await self._protocol.event_started.wait()
            await self.punch.event_started.wait()
            self._gate(STOP_PROTOCOL, self._protocol._handle_stop_stream)
            self._gate(DCUTR_PROTOCOL, self.punch._handle_dcutr_stream)
            if self.settings.serve:
                self._gate(HOP_PROTOCOL, self._protocol._handle_hop_stream)
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def direct_to(self, peer_id: str) -> bool:
        """Whether this node holds a direct (not relayed) connection to `peer_id`."""
        pid = libp2p_peer_id(peer_id)
        return pid is not None and any(
            not is_relayed(c) for c in self._host.get_network().get_connections(pid)
        )

    def _gate(self, protocol: str, handler: Callable[[INetStream], Any]) -> None:
        async def gated(stream: INetStream) -> None:
            peer = str(stream.muxed_conn.peer_id)
            if not self._admits(peer):
                await stream.reset()
                return
            await handler(stream)

        self._host.set_stream_handler(protocol, gated)  # type: ignore[arg-type]

    async def dial(self, multiaddr: str, timeout_s: float) -> None:
        """Connect to a peer through the relay its address names (a full circuit address,
        `<relay>/p2p-circuit/p2p/<peer>`)."""
        peer = multiaddr.rsplit("/p2p/", 1)[-1]
        try:
            with trio.fail_after(timeout_s):  # the library has none on a second dial
                await self._dialer.dial(Multiaddr(multiaddr))
        except trio.TooSlowError:
            raise DialTimeoutError(
                f"connecting to {multiaddr} through its relay took more than {timeout_s:g} s",
                peer,
            ) from None
        except _RELAY_ERRORS as exc:
            raise DialError(
                f"cannot connect to {multiaddr} through its relay: {exc}", peer
            ) from exc

    def candidates(self) -> list[str]:
        """Connected peers that say (identify) they relay, in a stable order."""
        peerstore = self._host.get_peerstore()
        found = []
        for pid in self._host.get_connected_peers():
            try:
                if peerstore.supports_protocols(pid, [HOP_PROTOCOL]):
                    found.append(str(pid))
            except PeerStoreError:  # a peer identify has not answered for yet
                continue
        return sorted(found)

    async def reserve(self, relay_peer_id: str, timeout_s: float) -> bool:
        """Hold a slot on `relay_peer_id` (renewed by the library until this node stops)."""
        if self._nursery is None:
            return False
        relay = ID.from_base58(relay_peer_id)
        try:
            with trio.fail_after(timeout_s):
                stream = await self._host.new_stream(relay, [HOP_PROTOCOL])
                try:
                    ok = await self._transport.reserve(stream, relay, self._nursery)
                finally:
                    with trio.move_on_after(_CLOSE_TIMEOUT_S):
                        await stream.close()
        except (trio.TooSlowError, *_RELAY_ERRORS) as exc:
            log.info("no slot on relay %s: %s", relay_peer_id[-8:], exc)
            return False
        if ok:
            self.reserved_on = relay_peer_id
        return bool(ok)
