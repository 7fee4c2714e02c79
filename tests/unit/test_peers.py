"""The peer table: EWMA measurements, immutable snapshots, bans that grow and decay."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from swarmd.net.peers import BanPolicy, PeerRow, PeerTable
from tests.threads import in_both_threads

T0 = 1_700_000_000.0


def test_rtt_is_the_lowest_of_the_window() -> None:
    table = PeerTable(rtt_window=3)
    assert table.get("b") is None
    table.record_rtt("b", 10.0, T0)
    assert table.get("b").rtt_ms == 10.0
    table.record_rtt("b", 20.0, T0 + 1)
    assert table.get("b").rtt_ms == 10.0
    table.record_rtt("b", 15.0, T0 + 2)
    assert table.get("b").rtt_ms == 10.0
    table.record_rtt("b", 30.0, T0 + 3)  # 10 leaves the window
    assert table.get("b").rtt_ms == 15.0


def test_a_stall_at_connect_is_forgotten_at_the_next_good_ping() -> None:
    table = PeerTable()
    table.record_rtt("p", 400.0, T0)  # answered while the peer was still loading
    table.record_rtt("p", 2.0, T0 + 5)
    assert table.get("p").rtt_ms == 2.0
    for i in range(3):
        table.record_rtt("p", 900.0, T0 + 10 + i)  # a busy spell
    assert table.get("p").rtt_ms == 2.0


def test_a_path_that_got_slower_is_followed_once_its_window_passes() -> None:
    table = PeerTable()
    for i in range(8):
        table.record_rtt("p", 2.0, T0 + i)
    for i in range(7):
        table.record_rtt("p", 80.0, T0 + 10 + i)
    assert table.get("p").rtt_ms == 2.0
    table.record_rtt("p", 80.0, T0 + 20)
    assert table.get("p").rtt_ms == 80.0


def test_layer_ms_is_an_ewma_that_expires() -> None:
    table = PeerTable(layer_alpha=0.5, layer_ms_ttl_s=60.0)
    assert table.layer_ms(T0) == {}
    table.record_layer_ms("p", 2.0, T0)
    table.record_layer_ms("p", 4.0, T0 + 1)  # 2 + 0.5 * (4 - 2)
    table.record_layer_ms("q", 1.0, T0 + 1)
    assert table.layer_ms(T0 + 1) == {"p": 3.0, "q": 1.0}
    row = table.get("p")
    assert row is not None and row.layer_ms == 3.0 and row.layer_ms_at == T0 + 1
    # A peer measured long ago is judged by its record again (and measured anew if used).
    assert table.layer_ms(T0 + 61.5) == {}
    with pytest.raises(ValueError):
        table.record_layer_ms("p", -1.0, T0)
    with pytest.raises(ValueError):
        PeerTable(layer_alpha=0.0)


def test_throughput_ewma_in_bytes_per_second() -> None:
    table = PeerTable(throughput_alpha=0.25)
    table.record_transfer("p", 1_000_000, 0.5, T0)
    assert table.get("p").throughput_bps == pytest.approx(2_000_000.0)
    table.record_transfer("p", 1_000_000, 1.0, T0 + 1)
    assert table.get("p").throughput_bps == pytest.approx(1_750_000.0)
    table.record_transfer("p", 10, 0.0, T0 + 2)  # unmeasurably fast: no rate learned
    assert table.get("p").throughput_bps == pytest.approx(1_750_000.0)
    assert table.get("p").last_seen == T0 + 2


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_samples_are_refused(bad: float) -> None:
    table = PeerTable()
    with pytest.raises(ValueError):
        table.record_rtt("p", bad, T0)
    with pytest.raises(ValueError):
        table.record_transfer("p", 100, bad, T0)
    assert "p" not in table


def test_non_numbers_are_refused() -> None:
    table = PeerTable()
    with pytest.raises(TypeError):
        table.record_rtt("p", True, T0)
    with pytest.raises(TypeError):
        table.record_rtt("p", "3", T0)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_bad_alpha_is_refused(alpha: float) -> None:
    with pytest.raises(ValueError):
        PeerTable(throughput_alpha=alpha)


@pytest.mark.parametrize("window", [0, -1])
def test_an_empty_rtt_window_is_refused(window: int) -> None:
    with pytest.raises(ValueError):
        PeerTable(rtt_window=window)


def test_seen_never_goes_backwards() -> None:
    table = PeerTable()
    table.seen("p", T0 + 10)
    table.seen("p", T0 + 5)
    assert table.get("p").last_seen == T0 + 10
    table.record_rtt("p", 1.0, T0 + 20)
    assert table.get("p").last_seen == T0 + 20


def test_snapshot_rows_are_immutable_sorted_and_detached() -> None:
    table = PeerTable()
    table.set_addrs("c", ["/ip4/10.0.0.3/tcp/1"])
    table.record_rtt("a", 3.0, T0)
    table.record_failure("b")
    table.record_failure("b")
    rows = table.snapshot()
    assert [r.peer_id for r in rows] == ["a", "b", "c"]
    assert rows[1] == PeerRow("b", (), None, None, None, 2)
    assert rows[2].addrs == ("/ip4/10.0.0.3/tcp/1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows[0].rtt_ms = 1.0  # type: ignore[misc]
    table.record_rtt("a", 100.0, T0 + 1)
    assert rows[0].rtt_ms == 3.0  # the old snapshot does not change
    assert table.get("missing") is None
    table.forget("a")
    assert [r.peer_id for r in table.snapshot()] == ["b", "c"]


def test_table_is_bounded_and_forgets_the_stalest_peer() -> None:
    table = PeerTable(max_peers=3)
    table.seen("old", T0)
    table.seen("mid", T0 + 1)
    table.seen("new", T0 + 2)
    table.seen("newest", T0 + 3)
    assert len(table) == 3
    assert "old" not in table
    assert {r.peer_id for r in table.snapshot()} == {"mid", "new", "newest"}


# --- bans -------------------------------------------------------------------------------


def test_ban_lengths_double_and_are_capped() -> None:
    table = PeerTable(ban_policy=BanPolicy(base_s=30.0, max_s=3600.0, decay_s=10_000.0))
    now = T0
    lengths = []
    for _ in range(10):
        until = table.ban("p", "bad frame", now)
        lengths.append(until - now)
        assert table.is_banned("p", now)
        assert table.is_banned("p", until - 0.001)
        assert not table.is_banned("p", until)
        now = until + 1.0  # the next offence comes right after the ban ends
    assert lengths == [30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0, 3600.0, 3600.0]


def test_ban_with_huge_offence_count_does_not_overflow() -> None:
    table = PeerTable(ban_policy=BanPolicy(base_s=1.0, max_s=5.0, decay_s=1e9))
    now = T0
    for _ in range(2000):
        now = table.ban("p", "x", now)
    assert table.offences("p", now) == 2000
    assert table.ban("p", "x", now) == now + 5.0


def test_offence_during_a_ban_does_not_escalate() -> None:
    table = PeerTable()
    until = table.ban("p", "timeout", T0)
    assert table.ban("p", "connection lost", T0 + 1) == until
    assert table.offences("p", T0 + 1) == 1
    assert table.bans(T0 + 1)[0].reason == "timeout"


def test_offences_decay_after_a_quiet_period() -> None:
    table = PeerTable(ban_policy=BanPolicy(base_s=30.0, max_s=3600.0, decay_s=600.0))
    now = T0
    for _ in range(3):  # 30, 60, 120 s
        now = table.ban("p", "bad", now)
    assert table.offences("p", now) == 3
    assert table.offences("p", now + 599.0) == 3
    assert table.offences("p", now + 600.0) == 2
    assert table.offences("p", now + 1200.0) == 1
    assert table.offences("p", now + 1e6) == 0
    # After one decay step the next ban is the 3rd offence again (120 s), not the 4th.
    assert table.ban("p", "bad", now + 600.0) == now + 600.0 + 120.0
    # After full decay it starts over at the base.
    later = now + 600.0 + 120.0 + 1e6
    assert table.ban("p", "bad", later) == later + 30.0


def test_bans_lists_active_bans_with_reason_and_remaining() -> None:
    table = PeerTable()
    table.ban("z", "garbage frame", T0)
    table.ban("a", "step timeout", T0 + 10)
    rows = table.bans(T0 + 20)
    assert [(r.peer_id, r.reason, r.remaining_s, r.offences) for r in rows] == [
        ("a", "step timeout", 20.0, 1),
        ("z", "garbage frame", 10.0, 1),
    ]
    assert [r.peer_id for r in table.bans(T0 + 35)] == ["a"]
    assert table.bans(T0 + 40) == ()
    assert not table.is_banned("never", T0)


def test_unban_lifts_the_ban_but_keeps_the_count() -> None:
    table = PeerTable()
    table.ban("p", "bad", T0)
    table.unban("p", T0 + 1)
    assert not table.is_banned("p", T0 + 1)
    assert table.offences("p", T0 + 1) == 1
    assert table.ban("p", "bad", T0 + 2) == T0 + 2 + 60.0
    table.unban("unknown", T0)


def test_bans_survive_forgetting_the_peer() -> None:
    table = PeerTable()
    table.seen("a", T0)
    table.ban("a", "bad", T0)
    table.forget("a")
    assert "a" not in table
    assert table.is_banned("a", T0 + 1)


def test_ban_entries_are_bounded_and_ended_ones_go_first() -> None:
    table = PeerTable(max_bans=2)
    table.ban("a", "bad", T0)  # ends at T0 + 30
    table.ban("b", "bad", T0 + 100)
    assert table.offences("a", T0 + 110) == 1  # ended but not yet forgiven
    table.ban("c", "bad", T0 + 110)  # full: "a" (ended first) makes room
    assert table.offences("a", T0 + 110) == 0
    assert [r.peer_id for r in table.bans(T0 + 110)] == ["b", "c"]
    table.ban("d", "bad", T0 + 120)  # full of active bans: the newest of the mildest goes
    assert [r.peer_id for r in table.bans(T0 + 120)] == ["b", "d"]


def test_thousands_of_throwaway_bans_never_evict_a_real_ban() -> None:
    """Before: a full table dropped the ban ending first, so 4,096 fresh peer ids banned
    after a real offender (a first offence ends soonest) pushed its ban out."""
    table = PeerTable()  # max_bans 4096
    table.ban("real", "sent garbage", T0)
    table.ban("repeat", "bad", T0 - 100.0)
    table.ban("repeat", "bad", T0)  # a second offence: 60 s
    for i in range(4200):
        table.ban(f"throwaway-{i}", "bad", T0 + 1 + i * 0.001)
    now = T0 + 10
    assert table.is_banned("real", now)
    assert table.is_banned("repeat", now)
    assert len(table.bans(now)) == 4096
    # Ended bans make room before any ban in force does.
    later = T0 + 31.5  # "real" (30 s) and every throwaway (30 s) have ended
    table.ban("next", "bad", later)
    assert table.is_banned("next", later)
    assert table.is_banned("repeat", later)


def test_a_repeat_offending_address_is_banned_for_fresh_peer_ids() -> None:
    table = PeerTable()
    table.ban("p1", "bad", T0, addr="203.0.113.7")
    assert not table.is_address_banned("203.0.113.7", T0 + 1)  # one offence: the peer only
    table.ban("p2", "bad", T0 + 5, addr="203.0.113.7")  # a second peer id, same address
    assert table.is_address_banned("203.0.113.7", T0 + 6)
    assert not table.is_address_banned("203.0.113.8", T0 + 6)
    assert not table.is_banned("fresh-id", T0 + 6)  # the id is new; its address is not
    assert not table.is_address_banned("203.0.113.7", T0 + 5 + 30)  # ends with the peer ban
    # Loopback (and junk) is never address-banned: nodes of one machine share it.
    for _ in range(3):
        table.ban(f"local-{_}", "bad", T0, addr="127.0.0.1")
    assert not table.is_address_banned("127.0.0.1", T0 + 1)
    table.ban("junk", "bad", T0, addr="not an ip")
    assert not table.is_address_banned("not an ip", T0 + 1)


def test_a_lost_peer_sits_out_for_growing_periods_but_is_never_banned() -> None:
    """A loss is no offence: the peer sits out of routes (periods as a ban's: 30, 60,
    120 s, one forgiven per quiet decay_s) and is never banned."""
    table = PeerTable(ban_policy=BanPolicy(base_s=30.0, max_s=3600.0, decay_s=600.0))
    now = T0
    lengths = []
    for _ in range(3):
        until = table.lose("p", "no token in 4 s", now)
        lengths.append(until - now)
        assert [o.peer_id for o in table.outs(until - 0.001)] == ["p"]
        assert table.outs(until) == ()
        assert not table.is_banned("p", now) and table.bans(now) == ()
        now = until + 1.0
    assert lengths == [30.0, 60.0, 120.0]
    assert table.lose("p", "again", now + 600.0) == now + 600.0 + 120.0  # one forgiven


def test_a_loss_while_sitting_out_is_the_same_incident_and_back_ends_the_period() -> None:
    table = PeerTable()
    until = table.lose("p", "no token in 4 s", T0)
    assert table.lose("p", "stream reset", T0 + 1) == until  # seven sessions, one loss
    (row,) = table.outs(T0 + 1)
    assert (row.reason, row.offences, row.remaining_s) == ("no token in 4 s", 1, until - T0 - 1)
    table.back("p", T0 + 5)  # it answered again
    assert table.outs(T0 + 5) == ()
    # Its loss still counts: lost again soon, it sits out twice as long.
    assert table.lose("p", "lost again", T0 + 10) == T0 + 10 + 60.0
    table.back("never-lost", T0)  # nothing to end: no error, no entry
    assert [o.peer_id for o in table.outs(T0 + 10)] == ["p"]


def test_ban_reasons_are_kept_as_one_safe_line() -> None:
    table = PeerTable()
    table.ban("p", "bad\nDIAG: forged line \x1b[31mred" + "x" * 1000, T0)
    (row,) = table.bans(T0)
    assert "\n" not in row.reason and "\x1b" not in row.reason
    assert row.reason.startswith("bad?DIAG: forged line ?[31mred")
    assert len(row.reason) <= 201


def test_the_table_is_read_whole_while_another_thread_feeds_it() -> None:
    table = PeerTable(max_peers=1_000_000)
    now = time.time()

    def write(i: int) -> None:
        table.record_layer_ms(f"peer-{i}", 1.0, now)
        table.record_rtt(f"peer-{i}", 5.0, now)

    def read() -> None:
        table.layer_ms(now)
        table.snapshot()

    assert in_both_threads(write, read) == []
    assert len(table) > 0
