"""The peers a node remembers in its data dir: newest first, capped, never trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmd.net.known_peers import MAX_ADDRS_PER_PEER, MAX_KNOWN_PEERS, KnownPeers


def addr(peer: str, port: int = 1) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"


def test_peers_are_remembered_newest_first_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "data" / "known_peers.json"
    known = KnownPeers(path)
    known.note("A", [addr("A")])
    known.note("B", [addr("B"), addr("B", 2)])
    known.note("A", [addr("A", 3)])  # seen again, at another address
    assert known.addrs == [addr("A", 3), addr("B"), addr("B", 2)]
    assert KnownPeers(path).addrs == known.addrs  # as a restarted node reads them


def test_only_the_most_recent_peers_and_addresses_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "known_peers.json"
    known = KnownPeers(path)
    for i in range(MAX_KNOWN_PEERS + 3):
        known.note(f"P{i}", [addr(f"P{i}", port) for port in range(1, MAX_ADDRS_PER_PEER + 3)])
    peers = [a.rsplit("/", 1)[1] for a in KnownPeers(path).addrs]
    assert list(dict.fromkeys(peers)) == [f"P{i}" for i in range(MAX_KNOWN_PEERS + 2, 2, -1)]
    assert len(peers) == MAX_KNOWN_PEERS * MAX_ADDRS_PER_PEER


def test_an_address_of_another_peer_or_without_a_peer_id_is_not_remembered(
    tmp_path: Path,
) -> None:
    known = KnownPeers(tmp_path / "known_peers.json")
    known.note("A", [addr("B"), "/ip4/127.0.0.1/tcp/1", "not an address", addr("A")])
    assert known.addrs == [addr("A")]
    known.note("C", [addr("B")])  # nothing of C's own: C is not noted at all
    assert known.addrs == [addr("A")]


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"peers": "nope"}),
        json.dumps([1, 2]),
        json.dumps({"peers": [{"peer_id": "A", "addrs": [addr("B"), 7]}, "junk", {"x": 1}]}),
    ],
)
def test_a_damaged_file_is_ignored_and_written_anew(tmp_path: Path, text: str) -> None:
    path = tmp_path / "known_peers.json"
    path.write_text(text)
    known = KnownPeers(path)
    assert known.addrs == []
    known.note("A", [addr("A")])
    assert KnownPeers(path).addrs == [addr("A")]


def test_without_a_path_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a file of no path, or a relative one, would land
    known = KnownPeers(None)
    known.note("A", [addr("A")])
    assert known.addrs == [addr("A")] and list(tmp_path.iterdir()) == []
