"""`SwarmPresence`: this node's life in the swarm, on the trio side of the bridge.

It owns the libp2p host, the DHT and the RPC service for as long as the node runs:
joins through the bootstrap peers, announces a signed record per model it serves and
renews it, stays in the swarm (`_stay_joined`: while no bootstrap peer answers, or once
it has lost every peer, it retries them and the peers it met before, with backoff, and
serves what it holds meanwhile, so start order never matters), pings the peers it
knows to keep the peer table's RTTs fresh, and withdraws its records when it stops.
Given `make_index`, it also keeps this node's entry in the swarm's model catalog
(`index.py`): republished with the records, with their expiry, and withdrawn after them.
Trio code only: the asyncio side reaches it through `TrioBridge`.

No single bad event stops it: every background loop (renewal, pings, joins, the gate) survives
any exception of one round (counted per loop in `loop_errors`, for ``/metrics``, and
logged without flooding), and the extra services' failure is reported the same way. In
a private swarm the DHT is gated like every other protocol (`_serves_dht`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from swarmd.dht.discovery import Discovery, open_discovery
from swarmd.dht.index import CatalogModel, IndexRecord, ModelEntry, catalog
from swarmd.dht.records import NodeRecord
from swarmd.dht.view import HoldersView
from swarmd.errors import ConfigError, InternalError, PeerError, SwarmError
from swarmd.net.auth import SwarmKey
from swarmd.net.dialback import COOLDOWN_S, DialBackService, Verdict, judge
from swarmd.net.gate import SwarmGate
from swarmd.net.host import P2PHost, check_peer_addr, open_host
from swarmd.net.identity import Identity
from swarmd.net.known_peers import KnownPeers
from swarmd.net.loop_errors import LoopErrors, first_of
from swarmd.net.peers import PeerRow, PeerTable
from swarmd.net.relay import Relay, RelaySettings
from swarmd.net.remote_addr import remote_ip, remote_ips
from swarmd.net.rpc import PING_TIMEOUT_S, RpcService, call_ping
from swarmd.net.safe_text import safe_text

log = logging.getLogger(__name__)
# A DIAG line that reports a state the node reached, not a failure: the diagnostics'
# failure list (`pipeline.report.FailureRing`) leaves it out.
NOTICE = {"notice": True}

WITHDRAW_TIMEOUT_S = 5.0  # the last announcement at shutdown
PING_INTERVAL_S = 5.0  # how often connected peers' RTTs are measured
# A lost holder asked whether it is back (no route without it) answers within this.
LOST_PING_TIMEOUT_S = 2.0
LOST_ASKED_MAX = 16  # lost holders asked at once
# One that did not answer is not asked again sooner: a burst of requests while a lost
# holder stays down each get their 503 at once, not after a ping's timeout apiece.
LOST_ASK_AGAIN_S = 5.0
JOIN_CHECK_S = 5.0  # how often a joined node checks it still has peers (and notes them)
JOIN_RETRY_MIN_S = 1.0  # the first retry of unreachable bootstrap peers ...
JOIN_RETRY_MAX_S = 15.0  # ... doubling up to this: a peer that comes up is met within it
RELAY_CHECK_S = 2.0  # how often a node without inbound connections checks its relay slot
RESERVE_TIMEOUT_S = 10.0  # one reservation on a relay
REACHABILITY_RECHECK_S = 600.0  # how often a verdict on this node's reachability is checked
# ... and how soon after no peer could answer: past a peer's one question a minute
# (dialback.COOLDOWN_S), or a peer that took the last one refuses the retry as too early
REACHABILITY_RETRY_S = COOLDOWN_S + 5.0
REACHABILITY_ASK = 3  # peers asked to dial this node back at once


@dataclass(frozen=True)
class SwarmSettings:
    listen_host: str
    listen_port: int  # 0 = any free port
    bootstrap: tuple[str, ...]
    republish_interval_s: float
    swarm_key: SwarmKey | None = None  # a private swarm: only peers that prove this key
    known_peers_path: Path | None = None  # where the peers met are remembered (data dir)
    announce: tuple[str, ...] = ()  # what peers must dial instead of the listen address
    listen: bool = True  # False: no inbound connection; reached through a relay
    relay: RelaySettings = field(default_factory=RelaySettings)
    # "auto": peers dial this node back to find out whether it is reachable (a node behind
    # NAT then takes a relay slot); "public"/"private": take it as said, ask nobody.
    reachability: str = "auto"


class SwarmPresence:
    def __init__(
        self,
        identity: Identity,
        settings: SwarmSettings,
        make_records: Callable[[P2PHost], Sequence[NodeRecord]] | None,
        services: Callable[[P2PHost], Awaitable[None]] | None = None,
        make_index: Callable[[P2PHost], Sequence[ModelEntry]] | None = None,
    ) -> None:
        """`make_records(host)`: this node's records, one per model it holds layers of
        (none: a node that only coordinates); None joins without announcing anything (a
        node that still looks for its files). `services(host)`: more protocols on this
        host (e.g. the stage service); it runs for as long as the host, and is cancelled
        with it. `make_index(host)`: the models this node lists in the swarm's catalog,
        asked at every announcement (after `make_records`); None lists nothing, and an
        empty list leaves the catalog."""
        self.identity = identity
        self._services = services
        self.settings = settings
        self.peers = PeerTable()
        self.loop_errors = LoopErrors()  # failed rounds of background loops, by loop
        self._make_records = make_records
        self._host: P2PHost | None = None
        self._discovery: Discovery | None = None
        self._ready = trio.Event()
        self._joined = trio.Event()  # set once in the swarm (alone by design, or failed)
        # True while bootstrap peers were given and none has answered yet (or every peer
        # was lost since): the node serves what it holds and keeps retrying.
        self.joining = False
        self.known = KnownPeers(settings.known_peers_path)
        self._failure: SwarmError | None = None
        self._last_records: dict[str, NodeRecord] = {}  # by model, as announced
        self._make_index = make_index
        self._last_index: IndexRecord | None = None  # as announced; None once withdrawn
        self._unanswered: dict[str, float] = {}  # lost peer -> when it last did not answer
        self.addrs: list[str] = []  # full multiaddrs, set once the host listens
        self.relay: Relay | None = None
        self._gate: SwarmGate | None = None
        self._rpc: RpcService | None = None
        # "public", "private" (reached through a relay, if one holds a slot) or "unknown"
        # (not checked yet, or no peer could answer).
        self.reachability = "private" if not settings.listen else settings.reachability
        if self.reachability == "auto":
            self.reachability = "unknown"
        self.reachability_detail = ""  # what the last check found, for diagnostics
        self._said_no_relay = False  # the warning that no peer relays, said once
        # The holders of the models this node routes, refreshed in the background: a
        # route is planned from it without walking the DHT.
        self.view = HoldersView(self.holders)

    @property
    def host(self) -> P2PHost:
        host = self._host  # read once: the trio thread clears it when the host ends
        if host is None:
            raise InternalError("the libp2p host is not running")
        return host

    @property
    def announced(self) -> list[str]:
        """What peers are told to dial (see `P2PHost.announced`); none before the host runs
        (and, for a node without inbound connections, until a relay holds a slot)."""
        host = self._host  # read once: the trio thread clears it when the host ends
        return host.announced if host is not None else []

    @property
    def host_or_none(self) -> P2PHost | None:
        """The host while it runs (for reading its state from outside trio)."""
        return self._host

    def rejected_records(self) -> dict[str, int]:
        """DHT records refused so far, by reason."""
        discovery = self._discovery  # read once, as `announced`
        return dict(discovery.stats.rejected) if discovery is not None else {}

    @property
    def rpc(self) -> RpcService:
        """The host's `/swarmd/rpc/1` service, to register more methods on."""
        if self._rpc is None:
            raise InternalError("the RPC service is not running")
        return self._rpc

    @property
    def discovery(self) -> Discovery:
        if self._discovery is None:
            raise InternalError("the DHT is not running")
        return self._discovery

    async def run(self) -> None:
        """Runs until cancelled; `wait_ready` returns once the first announcement is out.

        A failure is kept for `wait_ready`, never raised: an error escaping this background
        task would end the whole trio run.
        """
        try:
            async with (
                open_host(
                    self.identity,
                    self.settings.listen_port,
                    self.settings.listen_host,
                    announce=self.settings.announce,
                    listen=self.settings.listen,
                ) as host,
                open_discovery(
                    host, admits=self._not_banned, serves=self._serves_dht, seen=self._saw
                ) as discovery,
                trio.open_nursery() as nursery,
            ):
                host.admits = self._admits
                host.misbehaved = self.ban
                self._host = host
                self._rpc = RpcService(host)
                DialBackService(host).register(self._rpc)
                self.relay = Relay(host.libp2p, self.settings.relay, self._admits)
                await nursery.start(self.relay.run)
                host.circuit_dialer = self.relay.dial
                if self.settings.swarm_key is not None:
                    self._gate = SwarmGate(
                        host, self.settings.swarm_key, self.peers, self.loop_errors
                    )
                    nursery.start_soon(self._gate.watch)
                nursery.start_soon(self._ping_forever)
                if self._services is not None:
                    nursery.start_soon(self._run_services, host)
                self._discovery = discovery
                self.addrs = host.addrs
                try:
                    await self._join(discovery)
                    nursery.start_soon(self._stay_joined, discovery)
                    nursery.start_soon(self.view.run, self.loop_errors.report)
                    nursery.start_soon(self._stay_reachable)
                    if self._make_records is None:
                        self._ready.set()
                        await trio.sleep_forever()
                    await self._announce()
                    self._ready.set()
                    await self._renew_forever()
                except SwarmError as exc:
                    # Caught here, inside the nursery, so it is not wrapped in a group.
                    self._fail(exc)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(WITHDRAW_TIMEOUT_S):
                        await self._withdraw()
                    self._host = self._discovery = self._rpc = None
                    nursery.cancel_scope.cancel()
        except SwarmError as exc:
            self._fail(exc)
        except BaseExceptionGroup as group:
            cancelled, rest = group.split(trio.Cancelled)
            if cancelled is None:
                # A SwarmError that trio wrapped (a join that failed inside a nursery) is
                # still the reason to give; only a group without one is a bug.
                reason = first_of(group, SwarmError)
                if reason is None:
                    log.exception("the swarm layer failed")
                    reason = InternalError(f"the swarm layer failed: {group!r}")
                self._fail(reason)
                return
            # Stopping: py-libp2p may raise as its host winds down (a peer's stream
            # negotiating the DHT protocol as the DHT stops: KeyError '/ipfs/kad/1.0.0').
            # That is no failure of this node; the cancellation goes on. Anything else
            # that came with it is said, not swallowed.
            if rest is not None:
                _known, other = rest.split(KeyError)
                if other is not None:
                    log.warning("while the swarm layer stopped: %s", safe_text(repr(other), 500))
                else:
                    log.debug("while the swarm layer stopped: %r", rest)
            raise cancelled from None
        except Exception as exc:  # a bug in the swarm layer: keep the API up, say so
            log.exception("the swarm layer failed")
            self._fail(InternalError(f"the swarm layer failed: {exc!r}"))

    @property
    def failure(self) -> SwarmError | None:
        return self._failure

    def _fail(self, exc: SwarmError) -> None:
        log.error("DIAG: swarm layer stopped: %s", safe_text(exc, 500))
        self._failure = exc
        self._ready.set()
        self._joined.set()

    def _not_banned(self, peer_id: str) -> bool:
        """Neither the peer nor an address it is connected from is banned."""
        now = time.time()
        if self.peers.is_banned(peer_id, now):
            return False
        host = self._host
        if host is None:
            return True
        return not any(self.peers.is_address_banned(ip, now) for ip in remote_ips(host, peer_id))

    async def _serves_dht(self, peer_id: str) -> bool:
        """Who may send this node DHT requests: as `_admits`, waiting for the gate's
        verdict on a peer that has only just connected."""
        if not self._not_banned(peer_id):
            return False
        if self.settings.swarm_key is None:
            return True
        return self._gate is not None and await self._gate.admit(peer_id)

    def _admits(self, peer_id: str) -> bool:
        """Who may use this node's swarmd protocols (the auth protocol excepted)."""
        if not self._not_banned(peer_id):
            return False
        return self._gate is None or self._gate.allows(peer_id)

    async def ban(self, peer_id: str, reason: str) -> None:
        """Ban a peer (growing backoff) and cut its connections; each call is one more
        of its failures (`/api/peers`). A peer banned already is left as it is: one lost
        peer fails every session it served, and each reports it (the table would not
        escalate; the log said it once per session)."""
        now = time.time()
        self.peers.record_failure(peer_id)
        if self.peers.is_banned(peer_id, now):
            return
        addr = remote_ip(self._host, peer_id) if self._host is not None else None
        until = self.peers.ban(peer_id, reason, now, addr=addr)
        await self._cut_off(peer_id, "banned", until, reason)

    async def lose(self, peer_id: str, reason: str) -> None:
        """A stage of a route was lost (silent, or its connection broke): the peer sits
        out of routes for a while (`PeerTable.lose`), banned from nothing. Its connection,
        likely dead, is closed, so that the next contact dials afresh; it may dial back
        at once. Like `ban`, once per incident however many sessions report it."""
        now = time.time()
        self.peers.record_failure(peer_id)
        if self.peers.is_out(peer_id, now):
            return
        until = self.peers.lose(peer_id, reason, now)
        await self._cut_off(peer_id, "sits out", until, reason)

    async def _cut_off(self, peer_id: str, what: str, until: float, reason: str) -> None:
        """Say so, replan around it, and close its connection."""
        log.warning(
            "DIAG: peer %s peer=%s for_s=%.0f reason=%s",
            what,
            safe_text(peer_id[-8:]),
            until - time.time(),
            safe_text(reason),
        )
        self.view.refresh_soon()  # a route may need another holder of its range now
        if self._host is not None:
            await self._host.disconnect(peer_id)

    async def answering(self, peer_ids: set[str]) -> set[str]:
        """Of these lost peers, those that answer a ping now (all asked at once, each
        within LOST_PING_TIMEOUT_S; one that did not answer in the last LOST_ASK_AGAIN_S
        is not asked): their sit-out ends (`PeerTable.back`)."""
        back: set[str] = set()
        host = self._host
        if host is None:
            return back
        start = time.monotonic()
        unanswered = self._unanswered
        for peer_id, when in list(unanswered.items()):
            if start - when >= LOST_ASK_AGAIN_S:
                del unanswered[peer_id]
        asked = sorted(p for p in peer_ids if p not in unanswered)[:LOST_ASKED_MAX]

        async def ask(peer_id: str) -> None:
            answered = False
            try:
                await call_ping(host, peer_id, LOST_PING_TIMEOUT_S, rounds=1)
                answered = True
            except* PeerError:  # bare, or inside a group from trio's nurseries
                pass
            if answered:
                back.add(peer_id)

        async with trio.open_nursery() as nursery:
            for peer_id in asked:
                nursery.start_soon(ask, peer_id)
        for peer_id in asked:
            if peer_id not in back:
                unanswered[peer_id] = start
        now = time.time()
        for peer_id in sorted(back):
            if not self.peers.is_out(peer_id, now):
                continue  # requests at once asked it each: one of them said so
            self.peers.back(peer_id, now)
            log.warning("DIAG: peer back peer=%s: lost, it answers again", safe_text(peer_id[-8:]))
        return back

    async def announce_now(self) -> None:
        """Renew the records at once (e.g. once the API address is known)."""
        if self._discovery is not None and self._make_records is not None:
            await self._announce()

    async def wait_ready(self) -> None:
        """Until the first announcement is out (in the swarm, or still joining it)."""
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def wait_joined(self) -> None:
        """Until this node is in the swarm: a bootstrap peer answered (at once without
        bootstrap peers); raises the swarm layer's failure."""
        await self._joined.wait()
        if self._failure is not None:
            raise self._failure

    async def holders(self, model_id: str) -> list[NodeRecord]:
        """Every live holder of a model, this node included."""
        records = await self.discovery.holders(model_id)
        if self._gate is not None:
            # In a private swarm a record counts only once its owner has proved the key.
            records = [r for r in records if self._gate.allows(r.peer_id)]
        own = self._last_records.get(model_id)
        if own is not None:
            # A lookup may miss this node's own record; routes must still see its layers.
            records = [r for r in records if r.peer_id != own.peer_id] + [own]
        return records

    def _saw(self, record: NodeRecord) -> None:
        """A holder record that passed the DHT's checks: into the view, as `holders` would
        take it (in a private swarm, once its owner has proved the key)."""
        if self._gate is None or self._gate.allows(record.peer_id):
            self.view.saw(record)

    async def models(self) -> list[CatalogModel]:
        """The swarm's model catalog, this node's own entries included (hints only: an
        id is served while `holders` finds a record for it)."""
        indexes = await self.discovery.indexes()
        if self._gate is not None:
            # In a private swarm an index counts only once its owner has proved the key.
            indexes = [i for i in indexes if self._gate.allows(i.peer_id)]
        own = self._last_index
        if own is not None:
            # A lookup may miss this node's own index; its models are in the catalog.
            indexes = [i for i in indexes if i.peer_id != own.peer_id] + [own]
        return catalog(indexes, own_peer_id=self.identity.peer_id)

    async def _join(self, discovery: Discovery) -> None:
        """One try of the bootstrap peers; unreachable ones leave the node joining (the
        first swarm node of a restart need not be up yet), a malformed one is refused."""
        bootstrap = self.settings.bootstrap
        if not bootstrap:
            self._joined.set()  # the first node of a swarm: alone by design
            return
        for multiaddr in bootstrap:
            try:
                check_peer_addr(multiaddr)
            except PeerError as exc:
                raise ConfigError(f"--bootstrap: {exc}") from exc
        try:
            joined = await discovery.bootstrap(bootstrap)
        except PeerError as exc:
            self.joining = True
            log.warning(
                "DIAG: swarm joining: no bootstrap peer answers (%s); serving what this "
                "node holds and retrying them, and the peers it met before, with backoff",
                safe_text(exc),
            )
            return
        self._joined_through(joined)

    def _joined_through(self, peer_ids: Sequence[str]) -> None:
        now = time.time()
        for peer_id in peer_ids:
            self.peers.seen(peer_id, now)
        if self.joining:
            log.warning("DIAG: swarm joined through %d peer(s)", len(peer_ids), extra=NOTICE)
        else:
            log.info("joined the swarm through %d bootstrap peer(s)", len(peer_ids))
        self.joining = False
        self._joined.set()

    async def _stay_joined(self, discovery: Discovery) -> None:
        """Retry the way in while joining or alone; otherwise note the peers met."""
        delay = JOIN_RETRY_MIN_S
        while True:
            try:
                if self.joining or not self.host.connected_peers():
                    if await self._rejoin(discovery):
                        delay = JOIN_RETRY_MIN_S
                        continue
                    await trio.sleep(delay)
                    delay = min(delay * 2.0, JOIN_RETRY_MAX_S)
                    continue
                self._remember_peers()
            except Exception as exc:  # one bad round must not end the retries
                self.loop_errors.report("join", exc)
            await trio.sleep(JOIN_CHECK_S)

    async def _rejoin(self, discovery: Discovery) -> bool:
        """One try of the bootstrap peers and the peers met before; True once joined."""
        own = self.identity.peer_id
        candidates = [
            a
            for a in dict.fromkeys([*self.settings.bootstrap, *self.known.addrs])
            if not a.endswith(f"/p2p/{own}")
        ]
        if not candidates:
            return False
        if self.settings.bootstrap and not self.joining:
            self.joining = True
            log.warning("DIAG: swarm joining: every peer was lost; retrying the way in")
        reached = await self._reachable(candidates)
        if not reached:
            return False
        try:
            joined = await discovery.bootstrap(reached, quiet=True)
        except PeerError as exc:
            log.debug("no way into the swarm yet: %s", safe_text(exc))
            return False
        self._joined_through(joined)
        if self._ready.is_set():
            # The peers met now (a bootstrap node that was down, a restarted swarm) have
            # never seen this node's records: announce them at once, not a period later.
            try:
                await self._announce()
            except SwarmError as exc:
                log.warning("announcement after joining failed: %s", safe_text(exc))
        return True

    async def _reachable(self, candidates: Sequence[str]) -> list[str]:
        """The candidates that take a connection, dialed all at once: a remembered peer
        that is gone for good (a black hole costs the whole connect timeout) must not
        hold up the one that is back."""
        reached: list[str] = []

        async def dial(multiaddr: str) -> None:
            try:
                await self.host.connect(multiaddr)
            except PeerError as exc:
                log.debug("rejoining through %s failed: %s", multiaddr, safe_text(exc))
                return
            reached.append(multiaddr)

        async with trio.open_nursery() as nursery:
            for multiaddr in candidates:
                nursery.start_soon(dial, multiaddr)
        return reached

    async def _stay_reachable(self) -> None:
        """A node that takes no inbound connection, or that peers found they cannot dial
        (behind NAT), keeps a slot on a relay among its connected peers and announces that
        relay's circuit address (again whenever it moves to another relay). With
        `reachability` "auto", peers are asked to dial it back after it joins and every
        REACHABILITY_RECHECK_S; a node found reachable again drops the circuit addresses."""
        relay = self.relay
        if relay is None:
            return
        checks = self.settings.listen and self.settings.reachability == "auto"
        next_check = 0.0
        while True:
            try:
                if checks and trio.current_time() >= next_check and not self.joining:
                    next_check = trio.current_time() + await self._check_reachability()
                if self.reachability == "private":
                    await self._keep_relay_slot(relay)
                elif self.host.relayed:
                    await self._leave_relay(relay)
            except Exception as exc:  # one bad round must not end it
                self.loop_errors.report("relay", exc)
            await trio.sleep(RELAY_CHECK_S)

    async def _check_reachability(self) -> float:
        """Ask a few connected peers to dial this node back; the seconds until the next
        check."""
        host = self.host
        now = time.time()
        peers = [p for p in host.connected_peers() if not self.peers.is_banned(p, now)]
        if not peers:
            return RELAY_CHECK_S  # nobody to ask yet
        verdict = await judge(host, peers[:REACHABILITY_ASK], host.direct)
        self._take_verdict(verdict)
        return REACHABILITY_RETRY_S if verdict.reachability == "unknown" else REACHABILITY_RECHECK_S

    def _take_verdict(self, verdict: Verdict) -> None:
        if verdict.reachability == "unknown":
            self.reachability_detail = f"not known: {verdict.detail}"
            log.info("reachability not known: %s", verdict.detail)
            return
        before = self.reachability
        self.reachability = verdict.reachability
        if verdict.reachability == "public":
            self.reachability_detail = (
                f"public: {verdict.asked} peer(s) dialed it back at {', '.join(verdict.reached)}"
            )
        else:
            self.reachability_detail = (
                f"private: {verdict.asked} peer(s) dialed {', '.join(self.host.direct)} "
                "and reached nothing; reached through a relay"
            )
        if before != self.reachability:
            log.warning(
                "DIAG: reachability %s asked=%d reached=%s",
                self.reachability,
                verdict.asked,
                ",".join(verdict.reached) or "-",
                extra=NOTICE,
            )

    async def _leave_relay(self, relay: Relay) -> None:
        """Found reachable: peers are told the direct addresses again."""
        relay.reserved_on = None
        self.host.relayed = []
        log.warning("DIAG: reachable directly; circuit addresses withdrawn", extra=NOTICE)
        if self._ready.is_set():
            await self._announce()

    async def _keep_relay_slot(self, relay: Relay) -> None:
        host = self.host
        held = relay.reserved_on
        if held is not None and held in host.connected_peers():
            return
        if held is not None:
            log.warning("DIAG: relay lost relay=%s; looking for another", held[-8:])
            relay.reserved_on = None
            host.relayed = []
        now = time.time()
        for peer_id in relay.candidates():
            addrs = host.peer_addrs(peer_id)[:2]
            if self.peers.is_banned(peer_id, now) or not addrs:
                continue
            if await relay.reserve(peer_id, RESERVE_TIMEOUT_S):
                self._said_no_relay = False
                host.relayed = [f"{addr}/p2p-circuit" for addr in addrs]
                log.warning(
                    "DIAG: reachable through relay relay=%s addrs=%s",
                    peer_id[-8:],
                    ",".join(host.announced),
                    extra=NOTICE,
                )
                if self._ready.is_set():
                    await self._announce()
                return
        if not self._said_no_relay:
            self._said_no_relay = True
            log.warning(
                "DIAG: no relay among %d connected peer(s); peers that are not connected "
                "to this node cannot reach it (run a reachable node with --relay-service)",
                len(host.connected_peers()),
            )

    def _remember_peers(self) -> None:
        host = self.host
        now = time.time()
        for peer_id in host.connected_peers():
            if not self.peers.is_banned(peer_id, now):
                self.known.note(peer_id, host.peer_addrs(peer_id))

    async def _announce(self) -> None:
        if self._make_records is None:
            return
        records = self._make_records(self.host)
        for record in records:
            await self.discovery.announce(self.identity, record)
            self._last_records[record.model_id] = record
        if records:
            await self._announce_index(max(r.expires_at for r in records))

    async def _announce_index(self, expires_at: float) -> None:
        """This node's catalog entry, expiring with its records; a failure here never
        holds the records back (they, not the index, say what is served)."""
        if self._make_index is None:
            return
        try:
            entries = self._make_index(self.host)
            if entries:
                self._last_index = await self.discovery.announce_index(
                    self.identity, entries, expires_at
                )
            elif self._last_index is not None:
                self._last_index = None
                await self.discovery.withdraw_index(self.identity)
        except SwarmError as exc:
            log.warning("could not announce this node's models: %s", safe_text(exc))

    async def _withdraw(self) -> None:
        if self._discovery is None:
            return
        for record in list(self._last_records.values()):
            try:
                await self._discovery.withdraw(self.identity, record)
            except SwarmError as exc:
                log.warning("could not withdraw this node's records: %s", safe_text(exc))
        if self._last_index is not None:
            self._last_index = None
            try:
                await self._discovery.withdraw_index(self.identity)
            except SwarmError as exc:
                log.warning("could not withdraw this node's models: %s", safe_text(exc))

    async def _renew_forever(self) -> None:
        while True:
            await trio.sleep(self.settings.republish_interval_s)
            try:
                await self._announce()
            except SwarmError as exc:  # a DHT hiccup must not end the node
                log.warning("announcement failed, retrying next period: %s", safe_text(exc))
            except Exception as exc:  # nor anything else: the next period tries again
                self.loop_errors.report("renew", exc)

    async def _ping_forever(self) -> None:
        while True:
            if self._host is not None:
                try:
                    await self._refresh_peers()
                except Exception as exc:  # one bad round must not stop the pings
                    self.loop_errors.report("ping", exc)
            await trio.sleep(PING_INTERVAL_S)

    async def _refresh_peers(self) -> None:
        host = self.host
        for peer_id in host.connected_peers():
            rtt_s: float | None = None
            try:
                rtt_s = await call_ping(host, peer_id, timeout_s=PING_TIMEOUT_S)
            except* PeerError as group:  # bare, or inside a group from trio's nurseries
                self.peers.record_failure(peer_id)
                log.debug("ping %s failed: %s", peer_id[-8:], safe_text(group.exceptions[0]))
            if rtt_s is not None:
                self.peers.record_rtt(peer_id, rtt_s * 1000.0, time.time())

    async def _run_services(self, host: P2PHost) -> None:
        """The extra services; their failure is reported, never the end of the host."""
        services = self._services
        if services is None:
            return
        try:
            await services(host)
        except Exception as exc:
            self.loop_errors.report("services", exc)

    async def snapshot(
        self,
    ) -> tuple[list[str], tuple[PeerRow, ...], dict[str, int], set[str]]:
        """Connected peer ids, the peer table, rejected-record counts and the connected
        peers reached only through a relay (no direct connection, hole punched or not)
        (trio side)."""
        connected = self.host.connected_peers() if self._host is not None else []
        rejected = self._discovery.stats.as_dict() if self._discovery is not None else {}
        relay = self.relay
        relayed = {p for p in connected if relay is not None and not relay.direct_to(p)}
        return connected, self.peers.snapshot(), rejected, relayed
