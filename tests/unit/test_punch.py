"""Hole punching's fixes and limits (`swarmd/net/punch.py`), on stand-ins for the host."""

from __future__ import annotations

from typing import Any

from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import dcutr
from multiaddr import Multiaddr

from swarmd.net import punch
from swarmd.net.identity import Identity
from swarmd.net.punch import MAX_ADDRS, MAX_SESSIONS, SESSION_WINDOW_S, HolePunch, leads


def peer() -> ID:
    return ID.from_base58(Identity.generate().peer_id)


class Conn:
    """A direct TCP connection whose far end is `ip:port`."""

    def __init__(self, addr: str) -> None:
        self.addr = Multiaddr(addr)
        self.muxed_conn = self

    def get_transport_addresses(self) -> list[Multiaddr]:
        return [self.addr]

    def get_remote_address(self) -> tuple[str, int]:
        return self.addr.value_for_protocol("ip4"), int(self.addr.value_for_protocol("tcp"))


class Network:
    def __init__(self) -> None:
        self.connections: dict[ID, list[Conn]] = {}


class Host:
    """What HolePunch reads of a host: its id, listening sockets and connections."""

    def __init__(self, listening: list[str], advertised: list[str]) -> None:
        self.me = peer()
        self._listening = [Multiaddr(a) for a in listening]
        self._advertised = [Multiaddr(a) for a in advertised]
        self.network = Network()

    def get_id(self) -> ID:
        return self.me

    def get_transport_addrs(self) -> list[Multiaddr]:
        return self._listening

    def get_addrs(self) -> list[Multiaddr]:
        return self._advertised

    def get_network(self) -> Network:
        return self.network


RELAY = "/ip4/203.0.113.1/tcp/4001"


def behind_nat() -> Any:
    """A node listening on every interface, port 35001, that advertises only its relay's
    circuit address (what a node found private does)."""
    circuit = f"{RELAY}/p2p/{peer()}/p2p-circuit"
    return Host(["/ip4/0.0.0.0/tcp/35001"], [circuit])


def test_the_port_to_punch_is_the_listening_one_not_the_relays() -> None:
    host = behind_nat()
    # The library reads the advertised addresses: the relay's port, 4001.
    assert punch.listening(host) == [(4, "0.0.0.0", 35001)]
    assert dcutr._local_tcp_listen_addrs is punch.listening  # installed for the library


def test_one_side_of_a_pair_leads() -> None:
    a, b = peer(), peer()
    assert leads(a, b) != leads(b, a)
    assert not leads(a, a)


def test_a_peer_gets_a_few_sessions_a_window_one_at_a_time() -> None:
    hole = HolePunch(behind_nat())
    asker, other = peer(), peer()
    assert [hole.may_answer(asker, 100.0) for _ in range(MAX_SESSIONS + 1)] == [
        *[True] * MAX_SESSIONS,
        False,
    ]
    assert hole.may_answer(other, 100.0)  # each peer its own count
    assert hole.may_answer(asker, 100.0 + SESSION_WINDOW_S)  # the window has passed
    hole._in_progress.add(other)
    assert not hole.may_answer(other, 101.0)  # one at a time


def test_peers_that_asked_long_ago_are_forgotten(monkeypatch: Any) -> None:
    monkeypatch.setattr(punch, "MAX_PEERS_KEPT", 4)
    hole = HolePunch(behind_nat())
    old = [peer() for _ in range(5)]
    for p in old:
        assert hole.may_answer(p, 100.0)
    recent = peer()
    assert hole.may_answer(recent, 100.0 + SESSION_WINDOW_S + 1)  # over the cap: pruned
    assert set(hole._answered) == {recent}


def test_at_most_a_few_tcp_addresses_of_a_peer_are_punched() -> None:
    hole = HolePunch(behind_nat())
    said = [Multiaddr(f"/ip4/198.51.100.{i}/tcp/{4000 + i}").to_bytes() for i in range(20)]
    said.insert(0, Multiaddr(f"{RELAY}/p2p/{peer()}/p2p-circuit").to_bytes())
    said.insert(1, Multiaddr("/ip4/198.51.100.99/udp/4000").to_bytes())
    kept = hole._decode_observed_addrs(said)
    assert [str(a) for a in kept] == [
        f"/ip4/198.51.100.{i}/tcp/{4000 + i}" for i in range(MAX_ADDRS)
    ]


def test_another_peers_address_is_not_dialed_for_a_punch() -> None:
    host = behind_nat()
    relay, target = peer(), peer()
    host.network.connections[relay] = [Conn(RELAY)]
    hole = HolePunch(host)
    # The address book lists the relay's address under the peer reached through it.
    assert hole._elsewhere(target, Multiaddr(f"{RELAY}/p2p/{target}"))
    assert not hole._elsewhere(target, Multiaddr("/ip4/198.51.100.7/tcp/35002"))
    assert not hole._elsewhere(relay, Multiaddr(RELAY))  # its own address is its own
