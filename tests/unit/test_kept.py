"""The coordinator's ledger of conversations its routes keep (prefix reuse on a route)."""

from __future__ import annotations

from swarmd.dht.records import NodeRecord
from swarmd.model.prefix import MIN_PREFIX_TOKENS
from swarmd.pipeline.kept import KeptConversations, cut_steps, serves
from swarmd.pipeline.route import plan_route
from tests.unit.test_route import MODEL, L
from tests.unit.test_route import record as route_record

ME = "12D3KooWME"
A, B = "12D3KooWAAAA", "12D3KooWBBBB"


def record(peer: str, start: int, end: int, **changes: object) -> NodeRecord:
    return route_record(peer, start, end, 50.0, **{"version": "0.4.0", **changes})


RECORDS = [record(A, 0, 15), record(B, 15, 30)]
ROUTE = plan_route(MODEL, L, ME, RECORDS)
PROMPT = list(range(100, 140))  # 40 tokens
# What a finished turn fed: the prompt in two chunks, then six reply tokens one by one.
STEPS = [PROMPT[:32], PROMPT[32:], *([t] for t in range(500, 506))]


def ledger(clock: list[float] | None = None) -> KeptConversations:
    now = clock if clock is not None else [0.0]
    kept = KeptConversations(max_entries=3, max_age_s=60.0, clock=lambda: now[0])
    kept.remember(MODEL, ROUTE, "chatcmpl-1.1", STEPS, len(PROMPT))
    return kept


def test_a_next_turn_takes_the_route_and_the_positions_it_shares() -> None:
    kept = ledger()
    turn2 = [*PROMPT, 500, 501, 502, 503, 504, 505, 506, 7, 8, 9]
    taken = kept.take(MODEL, turn2, RECORDS, set())
    assert taken is not None
    route, resume = taken
    assert route == ROUTE and resume.sid == "chatcmpl-1.1"
    assert resume.length == len(PROMPT) + 6  # every position the caches hold
    assert resume.steps == [list(s) for s in STEPS]
    assert kept.take(MODEL, turn2, RECORDS, set()) is None  # taken once, as the stages do


def test_a_reply_cut_short_reuses_only_the_shared_start() -> None:
    """A client that edits the assistant's reply shares the prompt and part of the reply."""
    turn2 = [*PROMPT, 500, 501, 999, 7, 8]
    taken = ledger().take(MODEL, turn2, RECORDS, set())
    assert taken is not None and taken[1].length == len(PROMPT) + 2
    assert taken[1].steps == [PROMPT[:32], PROMPT[32:], [500], [501]]


def test_no_continuation_no_resume() -> None:
    kept = ledger()
    assert kept.take(MODEL, [*PROMPT, 1, 2], RECORDS, set()) is None  # only the prompt again
    assert kept.take(MODEL, [*PROMPT[:30], 1, 2, 3], RECORDS, set()) is None  # a shared start
    assert kept.take("other", [*PROMPT, 500, 501, 7], RECORDS, set()) is None  # another model
    assert len(kept) == 1


def test_a_route_that_no_longer_serves_is_not_resumed() -> None:
    turn2 = [*PROMPT, 500, 501, 7]
    assert ledger().take(MODEL, turn2, RECORDS, {B}) is None  # banned since
    assert ledger().take(MODEL, turn2, RECORDS[:1], set()) is None  # withdrawn
    moved = [RECORDS[0], record(B, 20, 30)]
    assert ledger().take(MODEL, turn2, moved, set()) is None  # holds other layers now
    old = [RECORDS[0], record(B, 15, 30, version="0.3.0")]
    assert ledger().take(MODEL, turn2, old, set()) is None  # reads no `resume`
    assert not serves(ROUTE, [RECORDS[0], record(B, 15, 30, state="draining")], set())
    assert ledger().take(MODEL, turn2, RECORDS, set()) is not None


def test_entries_age_out_and_the_oldest_goes_past_the_cap() -> None:
    clock = [0.0]
    kept = ledger(clock)
    clock[0] = 61.0
    assert kept.take(MODEL, [*PROMPT, 500, 501, 7], RECORDS, set()) is None
    for i in range(5):
        kept.remember(MODEL, ROUTE, f"s{i}.1", STEPS, len(PROMPT))
    assert len(kept) == 3
    taken = kept.take(MODEL, [*PROMPT, 500, 501, 7], RECORDS, set())
    assert taken is not None and taken[1].sid == "s4.1"  # of equals, the newest
    kept.take(MODEL, [*PROMPT, 500, 501, 7], RECORDS, set())
    taken = kept.take(MODEL, [*PROMPT, 500, 501, 7], RECORDS, set())
    assert taken is not None and taken[1].sid == "s2.1"  # s0 and s1 went past the cap
    assert len(kept) == 0


def test_the_longest_continuation_wins() -> None:
    kept = ledger()
    longer = [*STEPS, [506], [507]]
    kept.remember(MODEL, ROUTE, "chatcmpl-2.1", longer, len(PROMPT))
    turn = [*PROMPT, *range(500, 508), 1, 2]
    taken = kept.take(MODEL, turn, RECORDS, set())
    assert taken is not None and taken[1].sid == "chatcmpl-2.1"


def test_cut_steps() -> None:
    assert cut_steps([[1, 2, 3], [4], [5]], 4) == [[1, 2, 3], [4]]
    assert cut_steps([[1, 2, 3], [4], [5]], 2) == [[1, 2]]
    assert cut_steps([[1, 2, 3]], 0) == []


COPYING = [record(A, 0, 15, version="0.5.2"), record(B, 15, 30, version="0.5.2")]


def test_a_shared_start_on_the_planned_route_is_copied_and_stays_kept() -> None:
    """The same prompt again, or another that shares a long start with a kept
    conversation (a system prompt), copies that start on every stage of the route
    placement planned: the entry stays for the conversation's own next turn."""
    kept = ledger()
    planned = plan_route(MODEL, L, ME, COPYING)
    again = kept.take(MODEL, [*PROMPT, 1, 2], COPYING, set(), planned)
    assert again is not None
    route, resume = again
    assert route == planned and resume.copy and resume.sid == "chatcmpl-1.1"
    assert resume.length == len(PROMPT) and resume.steps == [PROMPT[:32], PROMPT[32:]]
    system = kept.take(MODEL, [*PROMPT[:30], 1, 2, 3], COPYING, set(), planned)
    assert system is not None and system[1].copy and system[1].length == 30
    assert system[1].steps == [PROMPT[:30]]
    assert len(kept) == 1  # copied, never taken
    # The conversation's next turn still takes it over, ahead of a copy.
    turn2 = [*PROMPT, 500, 501, 7]
    taken = kept.take(MODEL, turn2, COPYING, set(), planned)
    assert taken is not None and not taken[1].copy and taken[1].length == len(PROMPT) + 2
    assert len(kept) == 0


def test_no_copy_off_the_planned_route_nor_through_stages_before_0_5_2() -> None:
    short = [*PROMPT[: MIN_PREFIX_TOKENS - 1], 1, 2, 3]
    planned = plan_route(MODEL, L, ME, COPYING)
    assert ledger().take(MODEL, short, COPYING, set(), planned) is None  # under the minimum
    assert ledger().take(MODEL, [*PROMPT, 1], COPYING, set(), None) is None  # none planned
    other = [record(A, 0, 20, version="0.5.2"), record(B, 20, 30, version="0.5.2")]
    elsewhere = plan_route(MODEL, L, ME, other)
    assert [(s.start, s.end) for s in elsewhere.stages] == [(0, 20), (20, 30)]
    assert ledger().take(MODEL, [*PROMPT, 1], [*COPYING, *other], set(), elsewhere) is None
    old = plan_route(MODEL, L, ME, RECORDS)  # the same peers, at 0.4.0: they take, never copy
    assert ledger().take(MODEL, [*PROMPT, 1], RECORDS, set(), old) is None
    assert ledger().take(MODEL, [*PROMPT, 1], COPYING, {B}, planned) is None  # banned since


def test_forget_drops_an_entry() -> None:
    kept = ledger()
    kept.forget("chatcmpl-1.1")
    kept.forget("unknown.1")
    assert len(kept) == 0
