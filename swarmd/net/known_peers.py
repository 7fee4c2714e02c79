"""`KnownPeers`: the peers this node has met, remembered in its data dir.

A node whose bootstrap peers are down (a swarm restarted in another order, a home
machine that was off) dials these too: any live member of the swarm is a way in, and a
node started without `--bootstrap` finds its way back to a swarm it was part of.

The file is a hint, never trusted: each address is dialed with its `/p2p/` id, so Noise
proves the peer is the one remembered; an unreadable file is logged and started over.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from swarmd.net.safe_text import safe_text

log = logging.getLogger(__name__)

MAX_KNOWN_PEERS = 16  # the most recently seen; older ones are forgotten
MAX_ADDRS_PER_PEER = 4  # a peer's interfaces (127.0.0.1, a LAN address, an announced one)
FILE_NAME = "known_peers.json"


class KnownPeers:
    def __init__(self, path: Path | None) -> None:
        """`path`: the file (None remembers nothing, for a node without a data dir)."""
        self._path = path
        self._peers: dict[str, list[str]] = self._load()  # peer id -> addrs, newest first

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/), the most recently seen peer first."""
        return [addr for addrs in self._peers.values() for addr in addrs]

    def note(self, peer_id: str, addrs: Sequence[str]) -> None:
        """`peer_id` was seen now at `addrs` (full multiaddrs); saved if anything changed."""
        wanted = [a for a in addrs if _is_full_addr(a) and a.endswith(f"/p2p/{peer_id}")]
        wanted = list(dict.fromkeys(wanted))[:MAX_ADDRS_PER_PEER]
        if not wanted:
            return
        changed = self._peers.get(peer_id) != wanted
        self._peers.pop(peer_id, None)
        self._peers = {peer_id: wanted, **self._peers}
        while len(self._peers) > MAX_KNOWN_PEERS:
            self._peers.pop(next(reversed(self._peers)))
            changed = True
        if changed:
            self._save()

    def _load(self) -> dict[str, list[str]]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            body = json.loads(self._path.read_text())
            entries = body["peers"]
            if not isinstance(entries, list):
                raise ValueError("'peers' is not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: %s", self._path, safe_text(exc))
            return {}
        peers: dict[str, list[str]] = {}
        for entry in entries[:MAX_KNOWN_PEERS]:
            if not isinstance(entry, dict):
                continue
            peer_id, addrs = entry.get("peer_id"), entry.get("addrs")
            if not isinstance(peer_id, str) or not isinstance(addrs, list):
                continue
            kept = [
                a
                for a in addrs[:MAX_ADDRS_PER_PEER]
                if isinstance(a, str) and _is_full_addr(a) and a.endswith(f"/p2p/{peer_id}")
            ]
            if kept:
                peers[peer_id] = kept
        return peers

    def _save(self) -> None:
        if self._path is None:
            return
        body = {"peers": [{"peer_id": p, "addrs": a} for p, a in self._peers.items()]}
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, self._path)  # a crash mid-write leaves the old file whole
        except OSError as exc:
            log.warning("cannot remember peers in %s: %s", self._path, safe_text(exc))


def _is_full_addr(addr: str) -> bool:
    return addr.startswith("/") and "/p2p/" in addr and len(addr) <= 300
