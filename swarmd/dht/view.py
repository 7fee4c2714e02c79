"""`HoldersView`: the holders of the models this node routes, kept current in the background.

Planning a route must not walk the DHT: a walk took 524 ms on the first request after a
quiet spell, when a 2 s cache had lapsed. So the view refreshes every model it watches
every `refresh_s` in the background (trio side), takes at once every holder record this
node's DHT stores or meets (`saw`: a holder's renewal or withdrawal that reaches this
node), and a read is a dictionary lookup that drops the records expired since (a holder
that died disappears at its record's expiry even if a refresh is late). Only the first
read of a model walks the DHT (`fetch`; the model is watched from then on); concurrent
first reads share that one walk. A model nobody reads for `forget_after_s` stops being
refreshed, except the `pinned` ones (the models this node holds). A ban (a failover makes
one) asks for a refresh at once (`refresh_soon`), so a standby that appeared since is
seen; what is
stale costs that request a failover, never a hang: a refresh that fails keeps the last
records (they still expire on time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from swarmd.dht.records import NodeRecord
from swarmd.errors import SwarmError
from swarmd.net.safe_text import safe_text

log = logging.getLogger(__name__)

# How often a watched model's holders are looked up again. A lookup is a few ms of the
# trio loop's time, which a decode step on this node then waits for: not more often than
# the records change (renewed every 20 s). Renewals and withdrawals that reach this node
# (`saw`) and bans (`refresh_soon`) update the view at once in between.
REFRESH_S = 15.0
FORGET_AFTER_S = 600.0  # a model nobody read this long is no longer refreshed
MAX_WATCHED = 64  # models refreshed at once (the catalog lists at most this many)

Lookup = Callable[[str], Awaitable[list[NodeRecord]]]


@dataclass
class _Watched:
    records: list[NodeRecord] = field(default_factory=list)
    fetched: bool = False  # a lookup has answered at least once
    read_at: float = 0.0  # monotonic seconds of the last read
    busy: trio.Event | None = None  # set when the lookup in flight ends


class HoldersView:
    def __init__(
        self,
        lookup: Lookup,
        *,
        refresh_s: float = REFRESH_S,
        forget_after_s: float = FORGET_AFTER_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`lookup(model_id)`: a DHT walk for the model's live holders (this node's own
        record included); `clock`: unix seconds (records' expiry)."""
        self._lookup = lookup
        self._refresh_s = refresh_s
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._monotonic = monotonic
        self._watched: dict[str, _Watched] = {}
        self.pinned: set[str] = set()  # always refreshed (the models this node holds)
        self._wake = trio.Event()

    def read(self, model_id: str) -> list[NodeRecord] | None:
        """The model's live holders as last looked up, without the expired ones; None
        while no lookup of it has answered (then `fetch`). The API's thread calls it too: it
        only reads plain data (the trio thread replaces a model's records whole)."""
        watched = self._watched.get(model_id)
        if watched is None or not watched.fetched:
            return None
        watched.read_at = self._monotonic()
        now = self._clock()
        return [r for r in watched.records if r.expires_at > now]

    async def fetch(self, model_id: str) -> list[NodeRecord]:
        """The model's holders now: the view's when it has them, else one DHT walk (shared
        with concurrent callers); the model is watched from then on."""
        found = self.read(model_id)
        if found is not None:
            return found
        await self._refresh(model_id)
        found = self.read(model_id)
        return [] if found is None else found

    async def lookup_now(self, model_id: str) -> list[NodeRecord]:
        """A fresh DHT walk whatever the view has (e.g. to check a peer's addresses)."""
        await self._refresh(model_id, force=True)
        return self.read(model_id) or []

    def saw(self, record: NodeRecord) -> None:
        """A holder record that passed this node's checks (stored here by its owner's
        renewal, or met by a lookup): a watched model's view takes it at once, when it
        is that peer's newest (a "draining" record is its withdrawal)."""
        watched = self._watched.get(record.model_id)
        if watched is None or not watched.fetched:
            return
        held = next((r for r in watched.records if r.peer_id == record.peer_id), None)
        if held is not None and held.seq >= record.seq:
            return
        others = [r for r in watched.records if r.peer_id != record.peer_id]
        watched.records = others if record.state == "draining" else [*others, record]

    def refresh_soon(self) -> None:
        """Refresh the watched models now rather than at the next period (after a ban)."""
        self._wake.set()

    async def run(self, report: Callable[[str, Exception], None]) -> None:
        """Refresh every watched model each `refresh_s` (at once when woken); forever. A
        round that fails is `report`ed ("holders") and the next one tries again."""
        while True:
            with trio.move_on_after(self._refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._round()
            except Exception as exc:
                report("holders", exc)

    async def _round(self) -> None:
        now = self._monotonic()
        for model_id in list(self._watched):
            idle = now - self._watched[model_id].read_at
            if model_id not in self.pinned and idle > self._forget_after_s:
                del self._watched[model_id]
        async with trio.open_nursery() as nursery:
            for model_id in [*self._watched, *(self.pinned - set(self._watched))]:
                nursery.start_soon(self._refresh, model_id)

    async def _refresh(self, model_id: str, force: bool = False) -> None:
        watched = self._watched.get(model_id)
        if watched is None:
            if len(self._watched) >= MAX_WATCHED:
                self._forget_stalest()
            watched = self._watched[model_id] = _Watched(read_at=self._monotonic())
        if watched.busy is not None:
            busy = watched.busy
            await busy.wait()  # one walk at a time per model: take that one's answer
            if not force:
                return
            if watched.busy is not None:
                await watched.busy.wait()
                return
        watched.busy = trio.Event()
        try:
            watched.records = await self._lookup(model_id)
            watched.fetched = True
        except SwarmError as exc:  # the last records stay; they still expire on time
            log.debug("refreshing the holders of %s failed: %s", model_id, safe_text(exc))
            watched.fetched = True
        finally:
            busy, watched.busy = watched.busy, None
            busy.set()

    def _forget_stalest(self) -> None:
        unpinned = [m for m in self._watched if m not in self.pinned]
        if unpinned:
            del self._watched[min(unpinned, key=lambda m: self._watched[m].read_at)]
