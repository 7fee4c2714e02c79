"""Conversations a route keeps for their next turn: prefix reuse on a distributed route.

When a distributed session ends, every stage of its route keeps that session's cache
(its open asked `keep`: see `wire`), and this node remembers what those caches hold: the
route, the ring's session id and the steps fed. A request whose prompt continues one of
them - its whole prompt and some of its reply, the rule of one node (`model.prefix`) -
is opened on that same route with `resume`, and only the rest of its prompt is
prefilled; a stage that let the cache go makes the ring say so, and the request then
prefills from the start on a fresh session.

An entry is taken by the request that resumes it (as each stage takes its cache), and
when that request ends its own entry, longer, replaces it. A request that only shares a
start with a kept conversation (the same system prompt, the same prompt again) and was
planned onto that conversation's route anyway has every stage *copy* that start (since
0.5.2, `wire.COPY_SINCE`): the entry stays for the conversation's own next turn, and
the copy never moves a request off the route placement chose. Pure: no I/O, no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from swarmd.dht.records import NodeRecord
from swarmd.model.prefix import reuse
from swarmd.pipeline import wire
from swarmd.pipeline.route import Route

MAX_KEPT = 64  # conversations remembered per node (each stage's own LRU is in tokens)
MAX_AGE_S = 900.0  # an older entry is dropped: its stages have most likely let it go


@dataclass(frozen=True)
class Kept:
    """A finished distributed session whose caches its route's stages keep."""

    model_id: str
    route: Route
    sid: str  # the ring's session id: the stages keep its caches under it
    steps: tuple[tuple[int, ...], ...]  # every step fed, in order (what the caches hold)
    tokens: tuple[int, ...]  # the same ids, flat: what a next prompt is matched against
    prompt_length: int  # a next turn must repeat more than this (its prompt and more)
    at: float


@dataclass(frozen=True)
class Resume:
    """What a request resumes: the kept session, and how many of its positions."""

    sid: str
    length: int  # positions every stage takes over (the caller prefills the rest)
    steps: list[list[int]]  # the kept steps cut to `length` tokens (a failover replays them)
    copy: bool = False  # every stage copies them: the kept conversation stays kept


class KeptConversations:
    def __init__(
        self,
        max_entries: int = MAX_KEPT,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_entries = max_entries
        self._max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, Kept] = OrderedDict()  # oldest first, by sid

    def __len__(self) -> int:
        return len(self._entries)

    def remember(
        self,
        model_id: str,
        route: Route,
        sid: str,
        steps: Sequence[Sequence[int]],
        prompt_length: int,
    ) -> None:
        if not steps:
            return
        fed = tuple(tuple(step) for step in steps)
        flat = tuple(token for step in fed for token in step)
        self._entries[sid] = Kept(model_id, route, sid, fed, flat, prompt_length, self._clock())
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def take(
        self,
        model_id: str,
        prompt: Sequence[int],
        records: Sequence[NodeRecord],
        banned: Collection[str],
        planned: Route | None = None,
    ) -> tuple[Route, Resume] | None:
        """The kept conversation of `model_id` that `prompt` continues furthest, whose
        route these holders still serve (each stage's peer announces its range, reads
        `resume`, and is not banned): its route and what to resume; the entry is gone
        once taken. Else, given the `planned` route, the longest start `prompt` shares
        with a conversation kept on that same route, to copy (its entry stays). None:
        nothing to reuse."""
        self._expire()
        copyable = planned is not None and copies(planned, records)
        hops = _hops(planned) if planned is not None else ()
        best: tuple[int, Kept] | None = None  # a continuation: taken
        shared: tuple[int, Kept] | None = None  # a start kept on the planned route: copied
        for kept in self._entries.values():
            if kept.model_id != model_id or not serves(kept.route, records, banned):
                continue
            take, copy = reuse(kept.tokens, kept.prompt_length, prompt)
            # On a tie the newest: its stages are the likeliest to keep it still.
            if take and (best is None or take >= best[0]):
                best = (take, kept)
            on_route = copyable and _hops(kept.route) == hops
            if copy and on_route and (shared is None or copy >= shared[0]):
                shared = (copy, kept)
        if planned is not None and shared is not None and (best is None or shared[0] > best[0]):
            length, kept = shared
            self._entries.move_to_end(kept.sid)  # recently used: the last to go
            return planned, Resume(kept.sid, length, cut_steps(kept.steps, length), copy=True)
        if best is None:
            return None
        length, kept = best
        del self._entries[kept.sid]
        return kept.route, Resume(kept.sid, length, cut_steps(kept.steps, length))

    def forget(self, sid: str) -> None:
        """Drop an entry its route no longer holds (a copy of it missed on a stage)."""
        self._entries.pop(sid, None)

    def _expire(self) -> None:
        oldest = self._clock() - self._max_age_s
        for sid in [sid for sid, kept in self._entries.items() if kept.at < oldest]:
            del self._entries[sid]


def serves(route: Route, records: Sequence[NodeRecord], banned: Collection[str]) -> bool:
    """Whether every stage of `route` is still announced by its peer, who reads `resume`."""
    for stage in route.stages:
        if stage.peer_id in banned:
            return False
        if not any(
            r.peer_id == stage.peer_id
            and r.model_id == route.model_id
            and r.state == "ready"
            and r.layer_start <= stage.start
            and stage.end <= r.layer_end
            and wire.reads_resume(r.version)
            for r in records
        ):
            return False
    return True


def copies(route: Route, records: Sequence[NodeRecord]) -> bool:
    """Whether every stage's peer of `route` copies a kept cache (reads `copy`)."""
    versions = {r.peer_id: r.version for r in records}
    return all(wire.reads_copy(versions.get(peer, "0")) for peer in route.peers)


def _hops(route: Route) -> tuple[tuple[str, int, int], ...]:
    return tuple((s.peer_id, s.start, s.end) for s in route.stages)


def cut_steps(steps: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """The steps that fed the first `length` tokens (the last of them cut short)."""
    out: list[list[int]] = []
    left = length
    for step in steps:
        if left <= 0:
            break
        out.append(list(step[:left]))
        left -= len(out[-1])
    return out
