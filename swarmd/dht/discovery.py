"""Who serves which layers of a model: signed records on py-libp2p's Kademlia DHT (trio).

Each node serving model M publishes two things (`Discovery.announce`):

- its signed `NodeRecord` as the DHT value at ``record_key(M, peer_id)``;
- a provider entry for ``model_key(M)`` (the key every node serving M shares).

`Discovery.holders(M)` reverses that: the providers of ``model_key(M)``, then each one's
record, checked by `decode_record` against the peer and model it was looked up for.
Provider entries are only hints (libp2p keeps them 48 h and never checks them); the
signed record, with its short expiry, is what says a node serves M now. A node that
stops republishing disappears when its record expires; `Discovery.withdraw` makes it
disappear at once by publishing the same record in state "draining" (a draining record
beats any other state, so it replaces the "ready" one wherever the DHT compares them).

The swarm's catalog of model ids (`index.py`) follows the same pattern one level up:
every node that serves anything provides ``catalog_key()`` and keeps its signed
`IndexRecord` at ``index_key(peer_id)`` (`announce_index`); `models` takes the catalog's
providers, then each one's index, fetched, checked and pruned exactly as `holders`
fetches records. `withdraw_index` publishes an empty index with a higher seq.

Every node stores records for others only through `RecordValidator`, so a record that
is malformed, expired, forged, or filed under another peer's key is refused on arrival,
and never served back. Records returned by `holders` (and indexes returned by
`indexes`) are checked again.

Where py-libp2p 0.8.1 falls short, this module works around it (see
shared/notes/libp2p.md):

- `KadDHT.find_providers` and `get_value` answer from the local store when it has
  anything for the key, and never ask the network again: a node would never learn of a
  provider that announced after its first lookup, and would keep serving itself a cached
  record that expired. `holders` therefore asks the k closest peers for providers every
  time (through libp2p's per-peer GET_PROVIDERS helper), drops a cached record that our
  clock says is expired before `get_value`, and also asks the record's owner directly (so
  a withdrawal or an update is seen at once even by nodes that hold an older copy).
- libp2p keeps at most 20 providers per key, each for 48 h, so departed nodes would fill
  the slots: `holders` prunes from the local provider store every peer whose record it
  found expired, invalid or withdrawn.
- The DHT server logs a WARNING "Failed to read DHT message from stream" after nearly
  every request (harmless); it is filtered out.

All timeouts are in `DiscoveryConfig`; a lookup that runs out of time returns what it
found so far instead of raising. `clock` (unix seconds) decides expiry everywhere in this
module; libp2p's own bookkeeping (its 24 h value TTL, 48 h provider TTL) uses real time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import trio
from libp2p.abc import INetStream, IPeerStore
from libp2p.exceptions import BaseLibp2pError
from libp2p.kad_dht.common import BUCKET_SIZE as PROVIDER_SLOTS
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from libp2p.records.validator import Validator
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from swarmd.dht.index import (
    CatalogModel,
    IndexRecord,
    ModelEntry,
    catalog,
    catalog_key,
    decode_index,
    decode_index_for_key,
    index_key,
    index_rank,
    is_index_key,
    sign_index,
)
from swarmd.dht.records import (
    KEY_NAMESPACE,
    NodeRecord,
    RecordStats,
    decode_record,
    decode_record_for_key,
    model_key,
    record_key,
    sign_record,
)
from swarmd.errors import MalformedRecordError, PeerError, RecordError, WrongOwnerError
from swarmd.net.host import P2PHost, libp2p_peer_id
from swarmd.net.identity import Identity
from swarmd.net.safe_text import safe_text

__all__ = [
    "WITHDRAW_TTL_S",
    "Discovery",
    "DiscoveryConfig",
    "RecordValidator",
    "open_discovery",
]

log = logging.getLogger(__name__)

MAX_PROVIDERS_PER_ANSWER = 64  # providers taken from one peer's GET_PROVIDERS answer
MAX_PROVIDERS = 256  # providers of one key (holders of a model, catalog indexes) per lookup
_MAX_KNOWN_GOOD = 1024  # providers remembered as having had a valid record or index
_VALUE_PEERS = 20  # closest peers asked for a record or providers (libp2p's k)

Clock = Callable[[], float]
# What a value under the "swarmd" namespace decodes to, by its key's prefix.
_Value = TypeVar("_Value", NodeRecord, IndexRecord)

WITHDRAW_TTL_S = 5.0  # a withdrawal ("draining") record lives this long
_ADDR_TTL_S = 600  # how long addresses learned here (providers, add_peer) stay dialable
_IDENTIFY_POLL_S = 0.02  # add_peer: how often to look whether identify has finished
_NOISY_DHT_WARNING = "Failed to read DHT message from stream"
# What resetting a refused peer's stream may raise (it may be gone already).
_STREAM_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass(frozen=True)
class DiscoveryConfig:
    """Timeouts of every network wait in `Discovery` (seconds)."""

    lookup_timeout_s: float = 10.0  # an iterative closest-peer lookup (FIND_NODE rounds)
    rpc_timeout_s: float = 5.0  # one request to one peer (GET_PROVIDERS, GET_VALUE)
    record_timeout_s: float = 10.0  # fetching one holder's record (owner + DHT)
    fetch_timeout_s: float = 15.0  # fetching every holder's record, in one lookup
    publish_timeout_s: float = 15.0  # put_value or provide, in announce / withdraw
    refresh_timeout_s: float = 10.0  # the routing-table refresh after bootstrap
    add_peer_timeout_s: float = 5.0  # adding a peer (pings an old one if a bucket is full)
    stop_timeout_s: float = 5.0  # stopping the DHT service
    withdraw_ttl_s: float = WITHDRAW_TTL_S
    max_parallel_fetches: int = 32  # holders' records fetched at once (each is a lookup)


# --- the validator ----------------------------------------------------------------------


class RecordValidator(Validator):
    """py-libp2p's validator for the "swarmd" namespace: signed `NodeRecord`s, and
    signed `IndexRecord`s under index keys (``/swarmd/i/``, `is_index_key`).

    libp2p calls `validate` on every value it stores (ours and those other peers send)
    and on every value a lookup receives; raising refuses the value. `select` picks the
    best of several values for one key: invalid ones lose; the higher `seq` (the owner's
    later record) wins; of equal seq a withdrawal (a "draining" record, an empty index)
    beats anything else, then the later expiry wins; equal (seq, withdrawal, expiry) fall
    back to the bytes so every node picks the same one.
    """

    def __init__(
        self,
        clock: Clock = time.time,
        stats: RecordStats | None = None,
        admits: Callable[[str], bool] | None = None,
    ) -> None:
        self._clock = clock
        self.stats = stats if stats is not None else RecordStats()
        self._admits = admits  # owners whose records may be stored (not banned)
        # Told of every holder record that passes (stored here, or seen by a lookup): how
        # a node's view of the holders follows their renewals and withdrawals at once.
        self.seen: Callable[[NodeRecord], None] | None = None

    def validate(self, key: str, value: bytes) -> None:
        try:
            record = _decode_for_key(key, value, self._clock())
            if self._admits is not None and not self._admits(record.peer_id):
                raise WrongOwnerError(f"peer {record.peer_id[-8:]} is refused by this node")
        except RecordError as exc:
            self.stats.reject(exc)
            log.debug("refused DHT record at %s: %s", safe_text(key), safe_text(exc))
            raise
        self.stats.accept()
        if self.seen is not None and isinstance(record, NodeRecord):
            self.seen(record)

    def select(self, key: str, values: list[bytes]) -> int:
        now = self._clock()
        best_index = 0
        best_rank: tuple[int, bool, float, bytes] | None = None
        for index, value in enumerate(values):
            try:
                record = _decode_for_key(key, value, now)
            except RecordError:
                continue
            # The owner's latest record first (seq): a replayed older one always loses.
            rank = _rank(record, value)
            # `>=`: two copies of the same bytes tie, and the later one (the incoming
            # value, where libp2p compares [stored, incoming]) is taken, not refused.
            if best_rank is None or rank >= best_rank:
                best_index, best_rank = index, rank
        return best_index

    def is_valid(self, key: str, value: bytes) -> bool:
        """`validate` without counting (for values this node already holds)."""
        try:
            _decode_for_key(key, value, self._clock())
        except RecordError:
            return False
        return True


def _decode_for_key(key: str, value: bytes, now: float) -> NodeRecord | IndexRecord:
    """The value at `key`, checked as what the key's prefix says it holds."""
    if is_index_key(key):
        return decode_index_for_key(key, value, now)
    return decode_record_for_key(key, value, now)


def _rank(decoded: NodeRecord | IndexRecord, value: bytes) -> tuple[int, bool, float, bytes]:
    if isinstance(decoded, IndexRecord):
        return index_rank(decoded, value)
    return (decoded.seq, decoded.state == "draining", decoded.expires_at, bytes(value))


# --- discovery --------------------------------------------------------------------------


class Discovery:
    """The DHT of one node, as swarmd uses it. Made by `open_discovery`."""

    def __init__(
        self,
        host: P2PHost,
        dht: KadDHT,
        validator: RecordValidator,
        clock: Clock,
        config: DiscoveryConfig,
    ) -> None:
        self._host = host
        self._dht = dht
        self._validator = validator
        self._clock = clock
        self._config = config
        self._local_id = host.libp2p.get_id()
        self._announced: set[str] = set()  # model ids this node announced (not withdrawn)
        self._expiry: dict[str, float] = {}  # model id -> latest expiry this node signed
        self._seq = 0  # the seq of the latest record (or index) this node signed
        self._index_live = False  # this node's latest index lists models (not withdrawn)
        self._index_expiry = 0.0  # the latest expiry of an index this node signed
        self._known_good: dict[str, float] = {}  # peer id -> expiry of its valid record
        self._keep_provider_slots_open(dht.provider_store)
        self._fetch_limiter = trio.CapacityLimiter(config.max_parallel_fetches)

    @property
    def stats(self) -> RecordStats:
        """Records accepted and refused by this node (by its validator and `holders`)."""
        return self._validator.stats

    @property
    def dht(self) -> KadDHT:
        """The py-libp2p DHT itself (diagnostics and tests)."""
        return self._dht

    def routing_table_peers(self) -> list[str]:
        return sorted(str(pid) for pid in self._dht.routing_table.get_peer_ids())

    # --- joining ----------------------------------------------------------------------

    async def bootstrap(self, multiaddrs: Sequence[str], quiet: bool = False) -> list[str]:
        """Join the swarm through these full multiaddrs (/ip4/…/tcp/…/p2p/PEER_ID).

        Connects to each one (in order), adds it to the routing table, then looks this
        node up through them to fill the table. Returns their peer ids. An address that
        is malformed, is this node, or cannot be reached is logged (at debug level when
        `quiet`: a retry of addresses already reported) and skipped; only when none works
        is the first DialError (or DialTimeoutError, naming it) raised.
        """
        peer_ids: list[str] = []
        failures: list[PeerError] = []
        for multiaddr in multiaddrs:
            try:
                peer_id = await self._host.connect(multiaddr)  # DialError names the address
                await self.add_peer(peer_id)
            except PeerError as exc:
                # One dead bootstrap peer is no reason to stay out of the swarm.
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "bootstrap through %s failed: %s",
                    safe_text(multiaddr),
                    safe_text(exc),
                )
                failures.append(exc)
                continue
            peer_ids.append(peer_id)
        if failures and not peer_ids:
            raise failures[0]
        if peer_ids:
            await self.refresh()
        return peer_ids

    async def refresh(self) -> None:
        """Refresh the routing table (lookups of this node and of random keys)."""
        with trio.move_on_after(self._config.refresh_timeout_s) as scope:
            await self._dht.refresh_routing_table()
        if scope.cancelled_caught:
            log.warning(
                "DHT routing-table refresh took over %g s; continuing with %d peers",
                self._config.refresh_timeout_s,
                self._dht.get_routing_table_size(),
            )

    async def add_peer(self, peer_id: str, addrs: Sequence[str] = ()) -> bool:
        """Add a peer to the routing table; True if it is there now.

        For peers that connect to this node on their own (libp2p adds a peer by itself
        only when the peer sends a DHT request). The routing table needs a dialable
        address: `addrs` (multiaddrs, with or without /p2p/), else what identify learned.
        For a connected peer whose identify is still running, waits for it (at most
        add_peer_timeout_s). False if no address was learned in time or libp2p refused
        the peer (a full bucket of live peers, a peer that does not serve the DHT).
        Raises PeerError for a malformed peer id or address.
        """
        pid = _parse_peer_id(peer_id)
        libp2p_host = self._host.libp2p
        peerstore = libp2p_host.get_peerstore()
        if addrs:
            peerstore.add_addrs(pid, [_parse_addr(a, peer_id) for a in addrs], _ADDR_TTL_S)
        with trio.move_on_after(self._config.add_peer_timeout_s):
            while not _known_addrs(peerstore, pid):
                if pid not in libp2p_host.get_connected_peers():
                    log.debug("no address known for peer %s; not added", peer_id[-8:])
                    return False
                await trio.sleep(_IDENTIFY_POLL_S)  # identify fills the peerstore
            return bool(await self._dht.add_peer(pid))
        return False

    # --- publishing -------------------------------------------------------------------

    async def announce(self, identity: Identity, record: NodeRecord) -> None:
        """Publish (or republish) this node's signed record for `record.model_id`.

        Stores it at ``record_key`` on the closest peers and registers this node as a
        provider of ``model_key``. Raises WrongOwnerError if `identity` or the record is
        not this node's, another RecordError if the record would be refused (malformed,
        already expired, over the size limit) or if the DHT here holds a record of this
        node with a higher seq (a clock set back since). The record is signed with a
        fresh `seq`, so it beats this node's earlier records, a withdrawal included. A
        network that does
        not answer in time is logged: the record stays stored here and in reach of every
        node that asks this node; the next republish tries again.
        """
        self._check_own(identity, record.peer_id)
        record = dataclasses.replace(record, seq=self._next_seq())
        value = sign_record(identity, record)
        await self._put(record_key(record.model_id, record.peer_id), value)
        self._announced.add(record.model_id)
        self._expiry[record.model_id] = max(
            record.expires_at, self._expiry.get(record.model_id, 0.0)
        )
        await self._provide(model_key(record.model_id), repr(record.model_id))

    async def withdraw(self, identity: Identity, record: NodeRecord) -> None:
        """Stop serving `record.model_id`: publish the record as "draining".

        Other nodes' `holders` stop listing this node at once (the draining record, with
        a higher seq, replaces the ready one). It lives `withdraw_ttl_s`, or longer when
        an earlier record of this node lives longer, so none of those can be replayed
        after it. A later `announce` (a higher seq) beats it at once.
        """
        self._check_own(identity, record.peer_id)
        # The withdrawal outlives every record it replaces: while one of them could still
        # be replayed, the withdrawal (with its higher seq) is there to beat it.
        expires_at = max(
            self._clock() + self._config.withdraw_ttl_s,
            record.expires_at,
            self._expiry.pop(record.model_id, 0.0),
        )
        draining = dataclasses.replace(
            record, state="draining", expires_at=expires_at, seq=self._next_seq()
        )
        self._announced.discard(record.model_id)
        await self._put(
            record_key(record.model_id, record.peer_id), sign_record(identity, draining)
        )

    async def announce_index(
        self, identity: Identity, entries: Iterable[ModelEntry], expires_at: float
    ) -> IndexRecord:
        """Publish (or republish) this node's index: the models it serves, in the catalog.

        Stores the signed index at ``index_key`` and registers this node as a provider of
        ``catalog_key()``; returns the index as signed (entries sorted by id, a fresh
        seq). `expires_at` should be its records' (an index expires with them). Raises
        MalformedRecordError for no entries (`withdraw_index` lists none), an id listed
        twice or an entry `decode_index` refuses, and what `announce` raises otherwise;
        a network that does not answer in time is logged, as there.
        """
        self._check_own(identity, identity.peer_id)
        models = tuple(sorted(entries, key=lambda entry: entry.model_id))
        if not models:
            raise MalformedRecordError("an index lists a model at least; withdraw_index it")
        index = IndexRecord(self._host.peer_id, models, expires_at, self._next_seq())
        await self._put(index_key(index.peer_id), sign_index(identity, index))
        self._index_live = True
        self._index_expiry = max(expires_at, self._index_expiry)
        await self._provide(catalog_key(), "the catalog")
        return index

    async def withdraw_index(self, identity: Identity) -> IndexRecord:
        """Leave the catalog: publish an empty index with a higher seq.

        Other nodes' `models` stop listing this node's models at once; the empty index
        lives `withdraw_ttl_s`, or as long as this node's latest index would, so that one
        cannot be replayed after it. A later `announce_index` beats it at once.
        """
        self._check_own(identity, identity.peer_id)
        expires_at = max(self._clock() + self._config.withdraw_ttl_s, self._index_expiry)
        self._index_expiry = 0.0
        self._index_live = False
        index = IndexRecord(self._host.peer_id, (), expires_at, self._next_seq())
        await self._put(index_key(index.peer_id), sign_index(identity, index))
        return index

    async def _provide(self, key: str, what: str) -> None:
        with trio.move_on_after(self._config.publish_timeout_s) as scope:
            await self._dht.provide(key)
        if scope.cancelled_caught:
            log.warning(
                "announcing %s as a provider of %s took over %g s",
                self._host.short_id,
                what,
                self._config.publish_timeout_s,
            )

    async def _put(self, key: str, value: bytes) -> None:
        with trio.move_on_after(self._config.publish_timeout_s) as scope:
            try:
                await self._dht.put_value(key, value)
            except RecordError:
                raise  # our own validator refused it (already counted)
            except ValueError as exc:  # libp2p: "Refusing to replace newer value ..."
                raise RecordError(
                    f"the DHT holds a newer record at {key} (a higher seq: was the "
                    f"clock set back?): {exc}"
                ) from exc
        if scope.cancelled_caught:
            log.warning(
                "storing record %s on the DHT took over %g s (stored locally)",
                key,
                self._config.publish_timeout_s,
            )

    def _next_seq(self) -> int:
        """A seq above every earlier one of this node: wall-clock microseconds, so a
        restarted node (a fresh counter) still outranks what it signed before."""
        self._seq = max(self._seq + 1, int(self._clock() * 1_000_000))
        return self._seq

    def _check_own(self, identity: Identity, owner: str) -> None:
        if identity.peer_id != self._host.peer_id or owner != self._host.peer_id:
            raise WrongOwnerError(
                f"this node ({self._host.peer_id}) only publishes its own records, got "
                f"identity {identity.peer_id} and a record of {owner}"
            )

    # --- looking up -------------------------------------------------------------------

    async def holders(self, model_id: str) -> list[NodeRecord]:
        """The valid, unexpired, non-draining records of the nodes serving `model_id`.

        Sorted by peer id; this node is included if it announced the model. Takes at
        most about lookup_timeout_s + rpc_timeout_s + fetch_timeout_s; what was not
        found by then is left out. Refused records are counted in `stats`.

        Provider entries cost a peer nothing (any fresh peer id may claim any model), so
        none of them may hold the others up: every record fetch has its own deadline
        (record_timeout_s), up to max_parallel_fetches run at once, the holders seen
        valid before go first and the rest in random order, and a provider whose record
        is missing, invalid or withdrawn is dropped from the local provider store.
        """
        peers = await self._find_providers(model_key(model_id))
        if model_id in self._announced:
            peers.add(self._host.peer_id)

        async def fetch(peer_id: str) -> NodeRecord | None:
            return await self._fetch_record(model_id, peer_id)

        results = await self._fetch_each(peers, fetch)
        return [results[p] for p in sorted(results)]

    async def indexes(self) -> list[IndexRecord]:
        """The valid, unexpired, non-empty indexes of the catalog's providers.

        Sorted by peer id; this node's is included while it announces one. Found, bounded
        and pruned as `holders` finds records: a provider of the catalog key whose index
        is missing, invalid or withdrawn is dropped from the local provider store.
        """
        peers = await self._find_providers(catalog_key())
        if self._index_live:
            peers.add(self._host.peer_id)
        results = await self._fetch_each(peers, self._fetch_index)
        return [results[p] for p in sorted(results)]

    async def models(self) -> list[CatalogModel]:
        """The swarm's model ids (`catalog` of `indexes`): at most MAX_SWARM_MODELS,
        this node's own first, each with the peers that list it. Hints only: an id is
        served while `holders(id)` finds a record."""
        return catalog(await self.indexes(), own_peer_id=self._host.peer_id)

    async def _fetch_each(
        self, peers: set[str], fetch: Callable[[str], Awaitable[_Value | None]]
    ) -> dict[str, _Value]:
        """`fetch(peer)` for every peer, within fetch_timeout_s: what each one found.

        Provider entries cost a peer nothing, so none may hold the others up: up to
        max_parallel_fetches run at once, and the peers seen valid before go first, the
        rest in random order.
        """
        now = self._clock()
        self._known_good = {p: t for p, t in self._known_good.items() if t > now}
        order = sorted(peers, key=lambda p: (p not in self._known_good, random.random()))
        results: dict[str, _Value] = {}

        async def one(peer_id: str) -> None:
            async with self._fetch_limiter:
                found = await fetch(peer_id)
            if found is not None:
                results[peer_id] = found
                self._remember_good(peer_id, found.expires_at)

        with trio.move_on_after(self._config.fetch_timeout_s):
            async with trio.open_nursery() as nursery:
                for peer_id in order:
                    nursery.start_soon(one, peer_id)
        return results

    def _remember_good(self, peer_id: str, until: float) -> None:
        if peer_id not in self._known_good and len(self._known_good) >= _MAX_KNOWN_GOOD:
            return  # full of live holders already; this one just goes unprioritised
        self._known_good[peer_id] = max(until, self._known_good.get(peer_id, 0.0))

    async def _find_providers(self, key: str) -> set[str]:
        """Peer ids of the providers of `key`: this node's store + the k closest peers'.

        Not `KadDHT.find_providers`: it answers from the local store alone once that
        has any provider for the key.
        """
        key_bytes = key.encode("utf-8")
        store = self._dht.provider_store
        found = {str(info.peer_id) for info in store.get_providers(key_bytes)}
        peerstore = self._host.libp2p.get_peerstore()

        async def ask(peer: ID) -> None:
            with trio.move_on_after(self._config.rpc_timeout_s):
                # libp2p's per-peer GET_PROVIDERS (it catches and logs its own errors).
                providers, _closer = await store._get_providers_from_peer_with_closers(
                    peer, key_bytes
                )
                # A hostile peer may answer with thousands of made-up providers: take a
                # bounded number from each answer and in all.
                for info in providers[:MAX_PROVIDERS_PER_ANSWER]:
                    if len(found) >= MAX_PROVIDERS:
                        break
                    found.add(str(info.peer_id))
                    if info.addrs and info.peer_id != self._local_id:
                        peerstore.add_addrs(info.peer_id, info.addrs, _ADDR_TTL_S)

        await self._each_near_peer(key_bytes, ask, _VALUE_PEERS)
        return found

    async def _fetch_record(self, model_id: str, peer_id: str) -> NodeRecord | None:
        """The best record of `peer_id` for `model_id`, checked; None if none is usable."""

        def decode(value: bytes) -> NodeRecord:
            return decode_record(
                value, self._clock(), expected_peer_id=peer_id, expected_model_id=model_id
            )

        return await self._fetch_value(
            peer_id,
            record_key(model_id, peer_id),
            model_key(model_id),
            decode,
            lambda record: record.state == "draining",
            f"the record for {safe_text(model_id)}",
        )

    async def _fetch_index(self, peer_id: str) -> IndexRecord | None:
        """The best index of `peer_id`, checked; None if none is usable or it is empty."""

        def decode(value: bytes) -> IndexRecord:
            return decode_index(value, self._clock(), expected_peer_id=peer_id)

        return await self._fetch_value(
            peer_id,
            index_key(peer_id),
            catalog_key(),
            decode,
            lambda index: index.withdrawn,
            "the index",
        )

    async def _fetch_value(
        self,
        peer_id: str,
        key: str,
        provider_key: str,
        decode: Callable[[bytes], _Value],
        withdrawn: Callable[[_Value], bool],
        what: str,
    ) -> _Value | None:
        """`peer_id`'s best value at `key` (from the owner, and this node and the DHT),
        by `decode`; None if none is usable or it is a withdrawal. A provider of
        `provider_key` with nothing usable behind it is forgotten."""
        key_bytes = key.encode("utf-8")
        values: list[bytes] = []
        pid = libp2p_peer_id(peer_id)
        if pid is None:
            return None
        if peer_id == self._host.peer_id:
            own = self._dht.value_store.get(key_bytes)
            if own is not None:
                values.append(own.value)
        else:
            with trio.move_on_after(self._config.record_timeout_s):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ask_owner, pid, key_bytes, values)
                    nursery.start_soon(self._get_value, key, values)
        if not values:
            # No record anywhere: a provider entry with nothing behind it (a made-up id,
            # or a holder long gone) must not keep one of the key's few slots, nor its
            # addresses in the peerstore (libp2p's lookups in a small swarm start from
            # every peer there, and would keep dialling it).
            self._forget_provider(provider_key, peer_id)
            if pid != self._local_id and pid not in self._host.libp2p.get_connected_peers():
                self._host.libp2p.get_peerstore().clear_addrs(pid)
            return None
        best = values[self._validator.select(key, values)]
        try:
            found = decode(best)
        except RecordError as exc:
            self.stats.reject(exc)
            log.debug("dropped %s of %s: %s", what, peer_id[-8:], safe_text(exc))
            self._forget_provider(provider_key, peer_id)
            return None
        if withdrawn(found):
            self._forget_provider(provider_key, peer_id)
            return None
        return found

    async def _ask_owner(self, peer: ID, key_bytes: bytes, values: list[bytes]) -> None:
        """The owner's own copy: the freshest, if the owner is up."""
        await self._ask_peer(peer, key_bytes, values)

    async def _ask_peer(self, peer: ID, key_bytes: bytes, values: list[bytes]) -> None:
        with trio.move_on_after(self._config.rpc_timeout_s):
            # libp2p's per-peer GET_VALUE (it catches and logs its own errors).
            result = await self._dht.value_store._get_from_peer(peer, key_bytes, return_record=True)
            value = getattr(result, "value", None)
            if isinstance(value, bytes) and value:
                values.append(value)

    async def _get_value(self, key: str, values: list[bytes]) -> None:
        """This node's copy and those of the k closest peers to `key`.

        Not `KadDHT.get_value`: it answers from the local store alone once that holds
        the key, so a copy replayed into this node's store (an old "ready" record of a
        node that has withdrawn since) would be the answer for as long as it lives. The
        caller's `select` weighs every copy found here; the highest seq wins.
        """
        key_bytes = key.encode("utf-8")
        cached = self._dht.value_store.get(key_bytes)
        if cached is not None and self._validator.is_valid(key, cached.value):
            values.append(cached.value)

        async def ask(peer: ID) -> None:
            await self._ask_peer(peer, key_bytes, values)

        await self._each_near_peer(key_bytes, ask, _VALUE_PEERS)

    async def _each_near_peer(
        self, key_bytes: bytes, ask: Callable[[ID], Awaitable[None]], limit: int
    ) -> None:
        """`ask(peer)` of the `limit` peers closest to the key (a network lookup) and of
        the peers this node is connected to, each once, all at once. The connected ones
        are asked at the start: a lookup stalls on peers it cannot dial (a node behind
        NAT has no address but a relay's) for its whole timeout, and in a small swarm the
        connected peers are the closest anyway."""
        asked: set[ID] = {self._local_id}

        def start(nursery: trio.Nursery, peers: Iterable[ID]) -> None:
            for peer in peers:
                if peer not in asked:
                    asked.add(peer)
                    nursery.start_soon(ask, peer)

        async with trio.open_nursery() as nursery:
            start(nursery, self._host.libp2p.get_connected_peers()[:limit])
            with trio.move_on_after(self._config.lookup_timeout_s):
                closest = await self._dht.peer_routing.find_closest_peers_network(key_bytes)
                start(nursery, closest[:limit])

    def _keep_provider_slots_open(self, store: ProviderStore) -> None:
        """Make a full key evict a provider instead of refusing the newcomer.

        libp2p keeps at most k (20) providers per key and ignores every later one, so
        20 made-up peer ids that claim a model first would hide its honest holders from
        this node for 48 h. Here a full key drops one entry to take the newcomer: never
        this node's own; first one not seen with a valid record, then the one heard from
        least recently (honest holders re-announce every republish period).
        """
        add_provider = store.add_provider
        own = str(self._local_id)

        def add_evicting(key: bytes, provider: PeerInfo) -> None:
            slots = store.providers.get(key)
            if (
                slots is not None
                and len(slots) >= PROVIDER_SLOTS
                and str(provider.peer_id) not in slots
            ):
                candidates = [p for p in slots if p != own]
                if candidates:
                    victim = min(
                        candidates,
                        key=lambda p: (p in self._known_good, slots[p].timestamp),
                    )
                    del slots[victim]
            add_provider(key, provider)

        store.add_provider = add_evicting  # type: ignore[method-assign]

    def _forget_provider(self, provider_key: str, peer_id: str) -> None:
        """Drop a provider whose value is gone (libp2p keeps 20 per key for 48 h)."""
        if peer_id == self._host.peer_id:
            return
        providers = self._dht.provider_store.providers.get(provider_key.encode("utf-8"))
        if providers is not None:
            providers.pop(peer_id, None)


@asynccontextmanager
async def open_discovery(
    host: P2PHost,
    clock: Clock = time.time,
    config: DiscoveryConfig | None = None,
    admits: Callable[[str], bool] | None = None,
    serves: Callable[[str], Awaitable[bool]] | None = None,
    seen: Callable[[NodeRecord], None] | None = None,
) -> AsyncIterator[Discovery]:
    """Run a Kademlia DHT server on `host` (random walk off); stop it on exit.

    Values are accepted only in namespaces with a validator: "swarmd" (`RecordValidator`)
    and libp2p's "pk" and "ipns". `admits(owner)`: whose records may be stored; `seen`:
    told of every holder record that passes the validator.
    `serves(peer_id)`: who may send this node DHT requests at all (a private swarm's
    gate); the stream of a peer it refuses is reset unread, so that peer can neither
    read nor store records here, nor enter the routing table.
    """
    config = config or DiscoveryConfig()
    _filter_noisy_dht_warning()
    validator = RecordValidator(clock, admits=admits)
    validator.seen = seen
    dht = KadDHT(host.libp2p, DHTMode.SERVER, enable_random_walk=False, strict_validation=True)
    dht.register_validator(KEY_NAMESPACE, validator)
    if serves is not None:
        # KadDHT registered its own handler on construction: put the gate in front (and
        # in its place, should libp2p register it again on a mode switch).
        gated = _gated(dht.handle_stream, serves)
        dht.handle_stream = gated  # type: ignore[method-assign]
        host.libp2p.set_stream_handler(KAD_PROTOCOL_ID, gated)
    try:
        async with background_trio_service(dht) as manager:
            try:
                yield Discovery(host, dht, validator, clock, config)
            finally:
                with trio.move_on_after(config.stop_timeout_s, shield=True):
                    await manager.stop()
    finally:
        host.libp2p.remove_stream_handler(KAD_PROTOCOL_ID)


# --- helpers ----------------------------------------------------------------------------


def _gated(
    handler: Callable[[INetStream], Awaitable[None]], serves: Callable[[str], Awaitable[bool]]
) -> Callable[[INetStream], Awaitable[None]]:
    async def on_stream(stream: INetStream) -> None:
        if not await serves(str(stream.muxed_conn.peer_id)):
            with contextlib.suppress(*_STREAM_ERRORS):
                await stream.reset()
            return
        await handler(stream)

    return on_stream


def _parse_peer_id(peer_id: str) -> ID:
    pid = libp2p_peer_id(peer_id)
    if pid is None:
        raise PeerError(f"{peer_id!r} is not an Ed25519 peer id", peer_id)
    return pid


def _parse_addr(addr: str, peer_id: str) -> Multiaddr:
    """A transport multiaddr of `peer_id` (a trailing /p2p/ must name that peer)."""
    transport, _, named = addr.partition("/p2p/")
    if named and named != peer_id:
        raise PeerError(f"{addr!r} is an address of another peer than {peer_id}", peer_id)
    try:
        return Multiaddr(transport)
    except Exception as exc:  # multiaddr raises several unrelated types
        raise PeerError(f"{addr!r} is not a multiaddr: {exc}", peer_id) from exc


def _known_addrs(peerstore: IPeerStore, pid: ID) -> bool:
    try:
        return bool(peerstore.addrs(pid))
    except PeerStoreError:
        return False


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.text))


def _filter_noisy_dht_warning() -> None:
    dht_logger = logging.getLogger("libp2p.kad_dht.kad_dht")
    if not any(isinstance(f, _DropMessage) for f in dht_logger.filters):
        dht_logger.addFilter(_DropMessage(_NOISY_DHT_WARNING))
