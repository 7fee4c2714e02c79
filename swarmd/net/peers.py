"""The peer table: what this node measured about its peers, and whom it has banned.

No I/O and no clock: every method that needs the time takes ``now`` (unix seconds). The
networking code (the trio thread) feeds it samples; the scheduler and the diagnostics (the
API's thread) read `snapshot()` and `bans(now)`, so every public method holds a lock.

A peer's RTT is the lowest of its last ``rtt_window`` round trips (8: about 40 s of
pings). Route planning wants the path's delay, and a ping answered while the peer or this
node was busy (starting up, loading weights, computing) measures that stall instead. An
average (TCP's, alpha 1/8) kept such a sample for minutes: on a loaded machine one
peer's first pings held it at 51-58 ms beside its neighbours' 10 ms for ten requests
in a row, and the planner left it out. The minimum forgets a stall at the next good
ping, and follows a path that really got slower once its faster samples leave the
window. Throughput is an
exponentially weighted moving average: the first sample is taken as is, each later one
moves the estimate by ``alpha`` of the difference.

A peer's compute speed, milliseconds per layer for one token, is such an average too
(``layer_alpha``), of the decode steps this node's routes ran through it. It is what route
planning uses for that peer instead of the throughput its record claims, for
``layer_ms_ttl_s`` after the last sample: a peer measured slow (maybe only busy) is
avoided, and after that long it is judged by its record again and measured anew.

Bans grow with repeat offences and are forgotten with good behaviour (`BanPolicy`):

- the n-th offence bans for ``min(base_s * 2 ** (n - 1), max_s)``: 30 s, 60 s, 120 s ...
  up to one hour;
- each ``decay_s`` that passes after a ban ends without a new offence takes one offence
  off the count, so a peer that behaves for long enough starts again at ``base_s``;
- an offence while the peer is still banned does not escalate the ban (one broken
  connection often reports several failures at once); it is ignored.

The table is bounded (``max_peers``, ``max_bans``) because peers decide how many peer
ids we hear of; when full it forgets the peer seen least recently. A full ban table
makes room by dropping, in this order: entries already forgiven, bans that have ended
(kept only to count offences), and only then a ban in force: the least severe (fewest
offences), of those the newest. So fresh peer ids banned by the thousand (they cost an
attacker nothing) displace one another, never a ban that was there before them or a
repeat offender's.

A peer that was only lost (a stage that went silent or whose connection broke: a crash,
a network that dropped for a while) is not banned: it *sits out* (`lose`). Routes leave
it out for the same growing, decaying periods as a ban, but it may connect and use this
node's protocols meanwhile, its address takes no offence, and `back` ends its period
early once it answers again (route planning asks a sitting-out holder when no route
exists without it). Nothing it did was wrong: a home network's outage must not cost a
node an hour's exclusion, nor its housemates their address.

Peer ids are free, so bans also count against the address a peer came from (`ban(...,
addr=IP)`): every peer banned from one address is one offence of that address (with
the same decay), and from the second offence on the address itself is banned until the
latest peer ban from it ends (`is_address_banned`). Loopback and unspecified addresses
are never banned: several honest nodes of one machine (and every test) share them, and
a node cannot tell them apart by address. Private (LAN) addresses are banned like
public ones: a LAN peer has an address of its own.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from swarmd.net.safe_text import safe_text

__all__ = ["BanPolicy", "BanRow", "PeerRow", "PeerTable"]

R = TypeVar("R")


def _locked(method: Callable[..., R]) -> Callable[..., R]:
    """A public method of `PeerTable`, run under the table's lock."""

    @functools.wraps(method)
    def run(self: PeerTable, *args: Any, **kwargs: Any) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


@dataclass(frozen=True)
class BanPolicy:
    base_s: float = 30.0  # the first ban
    max_s: float = 3600.0  # no ban is longer
    decay_s: float = 600.0  # quiet time after a ban that forgives one offence


@dataclass(frozen=True)
class PeerRow:
    """One peer as the table knows it (immutable; None where never measured)."""

    peer_id: str
    addrs: tuple[str, ...]
    rtt_ms: float | None  # the lowest of the last `rtt_window` round trips
    last_seen: float | None  # unix seconds
    throughput_bps: float | None  # EWMA of transfer rates, bytes/s
    failures: int  # failed calls since the peer entered the table
    layer_ms: float | None = None  # EWMA of its measured ms per layer per token
    layer_ms_at: float | None = None  # unix seconds of the last such sample


@dataclass(frozen=True)
class BanRow:
    peer_id: str
    reason: str  # the latest offence
    until: float  # unix seconds
    remaining_s: float
    offences: int  # counting the one that caused this ban


class _Peer:
    __slots__ = (
        "addrs",
        "failures",
        "last_seen",
        "layer_ms",
        "layer_ms_at",
        "rtts",
        "throughput_bps",
    )

    def __init__(self, rtt_window: int) -> None:
        self.layer_ms: float | None = None
        self.layer_ms_at: float | None = None
        self.addrs: tuple[str, ...] = ()
        self.rtts: deque[float] = deque(maxlen=rtt_window)
        self.last_seen: float | None = None
        self.throughput_bps: float | None = None
        self.failures = 0


class _Ban:
    __slots__ = ("offences", "reason", "since", "until")

    def __init__(self, offences: int, reason: str, until: float, since: float) -> None:
        self.offences = offences
        self.reason = reason
        self.until = until
        self.since = since  # when this ban began


ADDRESS_BAN_OFFENCES = 2  # peers banned from one address before the address is banned


def _bannable_address(addr: str) -> str | None:
    """The canonical form of an IP that may be banned; None for loopback and junk."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    return ip.compressed


def _in_force(entries: dict[str, _Ban], peer_id: str, now: float) -> bool:
    entry = entries.get(peer_id)
    return entry is not None and now < entry.until


def _rows(entries: dict[str, _Ban], now: float) -> tuple[BanRow, ...]:
    """The entries in force at `now`, sorted by peer id."""
    return tuple(
        BanRow(pid, e.reason, e.until, e.until - now, e.offences)
        for pid, e in sorted(entries.items())
        if now < e.until
    )


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


def _check_sample(name: str, value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return float(value)


class PeerTable:
    """Per-peer measurements and bans; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        rtt_window: int = 8,
        throughput_alpha: float = 0.25,
        layer_alpha: float = 0.2,
        layer_ms_ttl_s: float = 600.0,
        ban_policy: BanPolicy | None = None,
        max_peers: int = 4096,
        max_bans: int = 4096,
    ) -> None:
        if not 0 < throughput_alpha <= 1:
            raise ValueError(f"throughput_alpha must be in (0, 1], got {throughput_alpha}")
        if not 0 < layer_alpha <= 1:
            raise ValueError(f"layer_alpha must be in (0, 1], got {layer_alpha}")
        if rtt_window < 1:
            raise ValueError(f"rtt_window must be at least 1, got {rtt_window}")
        if max_peers < 1 or max_bans < 1:
            raise ValueError("max_peers and max_bans must be at least 1")
        self._rtt_window = rtt_window
        self._throughput_alpha = throughput_alpha
        self._layer_alpha = layer_alpha
        self._layer_ms_ttl_s = layer_ms_ttl_s
        self._policy = ban_policy or BanPolicy()
        self._max_peers = max_peers
        self._max_bans = max_bans
        self._peers: dict[str, _Peer] = {}
        self._bans: dict[str, _Ban] = {}
        self._addr_bans: dict[str, _Ban] = {}  # by IP: offences, and until when banned
        self._outs: dict[str, _Ban] = {}  # lost peers: losses, and until when they sit out
        # The trio thread feeds it, the API's thread reads it (route planning, diagnostics).
        self._lock = threading.RLock()

    # --- measurements -------------------------------------------------------------------

    def _peer(self, peer_id: str) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            if len(self._peers) >= self._max_peers:
                stalest = min(self._peers, key=self._last_seen_key)
                del self._peers[stalest]
            peer = self._peers[peer_id] = _Peer(self._rtt_window)
        return peer

    def _last_seen_key(self, peer_id: str) -> float:
        last_seen = self._peers[peer_id].last_seen
        return -math.inf if last_seen is None else last_seen

    @_locked
    def seen(self, peer_id: str, now: float) -> None:
        """The peer was heard from at `now` (never moves last_seen backwards)."""
        peer = self._peer(peer_id)
        if peer.last_seen is None or now > peer.last_seen:
            peer.last_seen = now

    @_locked
    def set_addrs(self, peer_id: str, addrs: tuple[str, ...] | list[str]) -> None:
        self._peer(peer_id).addrs = tuple(addrs)

    @_locked
    def record_rtt(self, peer_id: str, ms: float, now: float) -> None:
        """A round trip to the peer took `ms` milliseconds (it is also seen at `now`)."""
        sample = _check_sample("ms", ms)
        self.seen(peer_id, now)
        self._peers[peer_id].rtts.append(sample)

    @_locked
    def record_transfer(self, peer_id: str, nbytes: int, seconds: float, now: float) -> None:
        """`nbytes` went to or came from the peer in `seconds`; updates throughput."""
        size = _check_sample("nbytes", nbytes)
        duration = _check_sample("seconds", seconds)
        self.seen(peer_id, now)
        if duration == 0:
            return  # too fast to measure: no rate to learn from
        peer = self._peers[peer_id]
        peer.throughput_bps = _ewma(peer.throughput_bps, size / duration, self._throughput_alpha)

    @_locked
    def record_layer_ms(self, peer_id: str, ms: float, now: float) -> None:
        """A decode step ran through the peer at `ms` milliseconds per layer."""
        sample = _check_sample("ms", ms)
        peer = self._peer(peer_id)
        peer.layer_ms = _ewma(peer.layer_ms, sample, self._layer_alpha)
        peer.layer_ms_at = now

    @_locked
    def layer_ms(self, now: float) -> dict[str, float]:
        """Each peer's measured ms per layer, for those sampled within `layer_ms_ttl_s`."""
        return {
            peer_id: peer.layer_ms
            for peer_id, peer in self._peers.items()
            if peer.layer_ms is not None
            and peer.layer_ms_at is not None
            and now - peer.layer_ms_at <= self._layer_ms_ttl_s
        }

    @_locked
    def record_failure(self, peer_id: str) -> int:
        """A call to the peer failed; returns its failure count."""
        peer = self._peer(peer_id)
        peer.failures += 1
        return peer.failures

    @_locked
    def forget(self, peer_id: str) -> None:
        """Drop the peer's measurements (its ban, if any, stays)."""
        self._peers.pop(peer_id, None)

    @_locked
    def get(self, peer_id: str) -> PeerRow | None:
        peer = self._peers.get(peer_id)
        return None if peer is None else self._row(peer_id, peer)

    @_locked
    def snapshot(self) -> tuple[PeerRow, ...]:
        """Every known peer, sorted by peer id."""
        return tuple(self._row(pid, self._peers[pid]) for pid in sorted(self._peers))

    @staticmethod
    def _row(peer_id: str, peer: _Peer) -> PeerRow:
        return PeerRow(
            peer_id=peer_id,
            addrs=peer.addrs,
            rtt_ms=min(peer.rtts) if peer.rtts else None,
            last_seen=peer.last_seen,
            throughput_bps=peer.throughput_bps,
            failures=peer.failures,
            layer_ms=peer.layer_ms,
            layer_ms_at=peer.layer_ms_at,
        )

    @_locked
    def __len__(self) -> int:
        return len(self._peers)

    @_locked
    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    # --- bans ---------------------------------------------------------------------------

    def _offences_now(self, ban: _Ban, now: float) -> int:
        """The offence count after decay: one forgiven per `decay_s` since the ban ended."""
        if now < ban.until:
            return ban.offences
        forgiven = int((now - ban.until) // self._policy.decay_s)
        return max(0, ban.offences - forgiven)

    @_locked
    def ban(self, peer_id: str, reason: str, now: float, addr: str | None = None) -> float:
        """Ban the peer for its offence at `now`; returns the time the ban ends.

        `addr`: the IP the peer is connected from, if known; it takes an offence too.
        `reason` is kept made safe for logs and reports (`safe_text`): it may quote a peer.
        """
        reason = safe_text(reason)
        until, new = self._offence(self._bans, peer_id, reason, now)
        if new and addr is not None:
            self._strike_address(addr, reason, now, until)
        return until

    def _offence(
        self, entries: dict[str, _Ban], peer_id: str, reason: str, now: float
    ) -> tuple[float, bool]:
        """One more offence (or loss) of the peer in `entries`: when its period ends, and
        whether it began one (False: one in force already, the same incident reported
        again, which does not escalate)."""
        entry = entries.get(peer_id)
        if entry is not None and now < entry.until:
            return entry.until, False
        offences = (self._offences_now(entry, now) if entry is not None else 0) + 1
        until = now + self._length(offences)
        if entry is None:
            self._prune(entries, now)
        entries[peer_id] = _Ban(offences, reason, until, now)
        return until, True

    def _length(self, offences: int) -> float:
        policy = self._policy
        # Cap the exponent first: 2 ** huge would overflow a float.
        return min(policy.base_s * 2.0 ** min(offences - 1, 64), policy.max_s)

    def _strike_address(self, addr: str, reason: str, now: float, peer_until: float) -> None:
        key = _bannable_address(addr)
        if key is None:
            return
        entry = self._addr_bans.get(key)
        if entry is None:
            self._prune(self._addr_bans, now)
            entry = self._addr_bans[key] = _Ban(0, reason, now, now)
        else:
            entry.offences = self._offences_now(entry, now)
        entry.offences += 1
        entry.reason = reason
        if entry.offences >= ADDRESS_BAN_OFFENCES:
            if now >= entry.until:
                entry.since = now
            entry.until = max(entry.until, peer_until)

    @_locked
    def is_address_banned(self, addr: str, now: float) -> bool:
        """Whether peers connecting from IP `addr` are refused at `now`."""
        key = _bannable_address(addr)
        entry = self._addr_bans.get(key) if key is not None else None
        return entry is not None and now < entry.until

    # --- lost peers sitting out -------------------------------------------------------

    @_locked
    def lose(self, peer_id: str, reason: str, now: float) -> float:
        """The peer was lost at `now` (silent, or its connection broke): it sits out of
        routes for a period that grows and decays as a ban does; returns its end. A loss
        while it sits out already is the same incident, reported again."""
        return self._offence(self._outs, peer_id, safe_text(reason), now)[0]

    @_locked
    def is_out(self, peer_id: str, now: float) -> bool:
        """Whether the peer sits out of routes at `now` (lost lately)."""
        return _in_force(self._outs, peer_id, now)

    @_locked
    def back(self, peer_id: str, now: float) -> None:
        """The lost peer answered again: its period ends at `now` (its losses still count,
        so a peer lost again soon sits out longer)."""
        out = self._outs.get(peer_id)
        if out is not None:
            out.until = min(out.until, now)

    @_locked
    def outs(self, now: float) -> tuple[BanRow, ...]:
        """The lost peers sitting out at `now`, sorted by peer id."""
        return _rows(self._outs, now)

    @_locked
    def unban(self, peer_id: str, now: float) -> None:
        """Lift the peer's ban at `now`; its offence count is kept and decays from `now`."""
        ban = self._bans.get(peer_id)
        if ban is not None:
            ban.until = min(ban.until, now)

    @_locked
    def is_banned(self, peer_id: str, now: float) -> bool:
        return _in_force(self._bans, peer_id, now)

    @_locked
    def bans(self, now: float) -> tuple[BanRow, ...]:
        """The bans in force at `now`, sorted by peer id."""
        return _rows(self._bans, now)

    @_locked
    def offences(self, peer_id: str, now: float) -> int:
        """The peer's offence count at `now`, after decay (0 for a peer never banned)."""
        ban = self._bans.get(peer_id)
        return 0 if ban is None else self._offences_now(ban, now)

    def _prune(self, bans: dict[str, _Ban], now: float) -> None:
        """Make room for one more entry in `bans` (see the module docstring for the order)."""
        if len(bans) < self._max_bans:
            return
        for key in [k for k, b in bans.items() if self._offences_now(b, now) == 0]:
            del bans[key]
        if len(bans) < self._max_bans:
            return
        ended = [k for k, b in bans.items() if b.until <= now]
        ended.sort(key=lambda k: bans[k].until)
        for key in ended[: len(bans) - self._max_bans + 1]:
            del bans[key]
        while len(bans) >= self._max_bans:
            # Least severe, then newest: a flood of fresh bans displaces only itself.
            victim = min(bans, key=lambda k: (bans[k].offences, -bans[k].since))
            del bans[victim]
