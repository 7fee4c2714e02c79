"""The DIAG line a finished request prints, the ring of recent requests, and the ledger of
failure reports that proved false (who gets banned for lying)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from swarmd.dht.swarm import NOTICE
from swarmd.pipeline.report import FailureRing, FalseReports, RequestRecord, RequestRing

PREFIX = "DIAG: request complete "


def record(**changes: object) -> RequestRecord:
    """A minimal record: only the required fields, everything optional left unmeasured."""
    base = RequestRecord(request_id="req-1", model="m", route="local", nodes=[], outcome="ok")
    return dataclasses.replace(base, **changes)


def fields(line: str) -> dict[str, str]:
    assert line.startswith(PREFIX)
    pairs = [part.split("=", 1) for part in line[len(PREFIX) :].split(" ")]
    assert all(len(p) == 2 for p in pairs), line
    return dict(pairs)


def keys(line: str) -> list[str]:
    return list(fields(line))


# --- diag_line ---------------------------------------------------------------------------


def test_minimal_record_prints_only_what_was_measured() -> None:
    line = record().diag_line()
    assert line == "DIAG: request complete request_id=req-1 route=local model=m outcome=ok"


def test_unmeasured_fields_are_absent_not_zero_or_none() -> None:
    line = record(tokens=1).diag_line()
    for name in (
        "segments",
        "nodes",
        "queue_ms",
        "sched_ms",
        "ttft_ms",
        "decode_ms",
        "total_ms",
        "prompt_tokens",
        "tok_per_sec",
        "tpot_ms",
        "seg0_ms",
        "activation_bytes",
        "failovers",
        "error_type",
    ):
        assert f"{name}=" not in line
    assert "None" not in line
    assert fields(line)["tokens"] == "1"


def test_measured_zeros_are_printed() -> None:
    line = record(queue_ms=0.0, failovers=0, activation_bytes=0, prompt_tokens=0).diag_line()
    got = fields(line)
    assert got["queue_ms"] == "0.0"
    assert got["failovers"] == "0"
    assert got["activation_bytes"] == "0"
    assert got["prompt_tokens"] == "0"


def test_full_distributed_record() -> None:
    rec = RequestRecord(
        request_id="req-42",
        model="smollm2-135m-instruct",
        route="distributed",
        nodes=["a1b2", "c3d4", "e5f6"],
        outcome="ok",
        queue_ms=1.26,
        sched_ms=0.5,
        ttft_ms=120.0,
        decode_ms=900.0,
        total_ms=1021.76,
        prompt_tokens=30,
        tokens=10,
        stage_ms=(12.0, 30.44, 0.25),
        activation_bytes=4096,
        failovers=1,
    )
    line = rec.diag_line()
    assert line.startswith("DIAG: request complete request_id=req-42 ")
    assert fields(line) == {
        "request_id": "req-42",
        "route": "distributed",
        "segments": "3",
        "model": "smollm2-135m-instruct",
        "nodes": "a1b2,c3d4,e5f6",
        "queue_ms": "1.3",
        "sched_ms": "0.500",
        "ttft_ms": "120.0",
        "decode_ms": "900.0",
        "total_ms": "1021.8",
        "prompt_tokens": "30",
        "tokens": "10",
        "tok_per_sec": "10.0",  # 9 tokens after the first in 0.9 s
        "tpot_ms": "100.0",
        "seg0_ms": "12.0",
        "seg1_ms": "30.4",
        "seg2_ms": "0.250",
        "activation_bytes": "4096",
        "failovers": "1",
        "outcome": "ok",
    }
    assert keys(line) == [
        "request_id",
        "route",
        "segments",
        "model",
        "nodes",
        "queue_ms",
        "sched_ms",
        "ttft_ms",
        "decode_ms",
        "total_ms",
        "prompt_tokens",
        "tokens",
        "tok_per_sec",
        "tpot_ms",
        "seg0_ms",
        "seg1_ms",
        "seg2_ms",
        "activation_bytes",
        "failovers",
        "outcome",
    ]


def test_segment_times_follow_route_order() -> None:
    line = record(nodes=["n0", "n1", "n2", "n3"], stage_ms=(4.0, 3.0, 2.0, 1.0)).diag_line()
    seg_keys = [k for k in keys(line) if k.startswith("seg") and k != "segments"]
    assert seg_keys == ["seg0_ms", "seg1_ms", "seg2_ms", "seg3_ms"]
    assert [fields(line)[k] for k in seg_keys] == ["4.0", "3.0", "2.0", "1.0"]
    assert fields(line)["segments"] == "4"


@pytest.mark.parametrize(
    ("tokens", "decode_ms", "tok_per_sec", "tpot_ms"),
    [
        (11, 500.0, 20.0, 50.0),  # 10 tokens after the first in 0.5 s
        (2, 40.0, 25.0, 40.0),
        (101, 2000.0, 50.0, 20.0),
        (5, 3.0, 1333.333, 0.75),
    ],
)
def test_speed_is_computed_from_tokens_after_the_first(
    tokens: int, decode_ms: float, tok_per_sec: float, tpot_ms: float
) -> None:
    rec = record(tokens=tokens, decode_ms=decode_ms)
    assert rec.tok_per_sec == pytest.approx(tok_per_sec, rel=1e-4)
    assert rec.tpot_ms == pytest.approx(tpot_ms, rel=1e-4)
    got = fields(rec.diag_line())
    assert float(got["tok_per_sec"]) == pytest.approx(tok_per_sec, abs=0.06)
    assert float(got["tpot_ms"]) == pytest.approx(tpot_ms, abs=0.06)


@pytest.mark.parametrize("tokens", [None, 0, 1])
def test_speed_is_absent_below_two_tokens(tokens: int | None) -> None:
    rec = record(tokens=tokens, decode_ms=250.0)
    assert rec.tok_per_sec is None
    assert rec.tpot_ms is None
    line = rec.diag_line()
    assert "tok_per_sec=" not in line
    assert "tpot_ms=" not in line
    assert fields(line)["decode_ms"] == "250.0"


def test_speed_is_absent_without_decode_time() -> None:
    rec = record(tokens=12)
    assert rec.tok_per_sec is None
    assert rec.tpot_ms is None
    assert "tok_per_sec=" not in rec.diag_line()


def test_error_outcome_and_type_come_last() -> None:
    line = record(outcome="error", error_type="ContextLengthError", ttft_ms=3.5).diag_line()
    assert line.endswith(" outcome=error error_type=ContextLengthError")
    assert keys(line)[-2:] == ["outcome", "error_type"]


def test_ok_outcome_has_no_error_type() -> None:
    line = record(outcome="ok").diag_line()
    assert line.endswith(" outcome=ok")
    assert "error_type" not in line


def test_float_formatting() -> None:
    got = fields(record(queue_ms=0.0123, sched_ms=7.0, ttft_ms=0.999, total_ms=1.04).diag_line())
    assert got["queue_ms"] == "0.012"  # below 1 ms: three decimals
    assert got["sched_ms"] == "7.0"
    assert got["ttft_ms"] == "0.999"
    assert got["total_ms"] == "1.0"


# --- RequestRing -------------------------------------------------------------------------


def test_ring_keeps_the_last_n_in_order() -> None:
    ring = RequestRing(size=3)
    for i in range(5):
        ring.add(record(request_id=f"r{i}"))
    assert [r.request_id for r in ring.recent()] == ["r2", "r3", "r4"]


def test_ring_below_capacity_keeps_everything() -> None:
    ring = RequestRing(size=3)
    assert ring.recent() == []
    ring.add(record(request_id="a"))
    ring.add(record(request_id="b"))
    assert [r.request_id for r in ring.recent()] == ["a", "b"]


def test_ring_default_size_is_fifty() -> None:
    ring = RequestRing()
    for i in range(60):
        ring.add(record(request_id=f"r{i}"))
    ids = [r.request_id for r in ring.recent()]
    assert ids == [f"r{i}" for i in range(10, 60)]


def test_recent_is_a_copy() -> None:
    ring = RequestRing(size=2)
    ring.add(record(request_id="a"))
    snapshot = ring.recent()
    snapshot.clear()
    ring.add(record(request_id="b"))
    assert [r.request_id for r in ring.recent()] == ["a", "b"]


def test_the_failure_ring_keeps_diag_lines_at_warning_and_above_but_notices() -> None:
    ring = FailureRing(size=2)
    logger = logging.getLogger("swarmd.test-failure-ring")
    logger.addHandler(ring)
    logger.propagate = False
    try:
        logger.warning("DIAG: stage failed request_id=%s peer=%s", "r1", "AAAA")
        logger.info("DIAG: request complete request_id=r0 outcome=ok")  # not a failure
        logger.warning("a warning that is not a DIAG line")
        logger.error("DIAG: peer banned peer=BBBB reason=%s", "garbage")
        logger.warning("DIAG: bad frame peer=CCCC")
        logger.warning("DIAG: reachability public asked=3 reached=A,B", extra=NOTICE)
    finally:
        logger.removeHandler(ring)
    lines = [f.line for f in ring.recent()]
    assert lines == ["DIAG: peer banned peer=BBBB reason=garbage", "DIAG: bad frame peer=CCCC"]
    assert all(f.logger == "swarmd.test-failure-ring" for f in ring.recent())


# --- false reports ----------------------------------------------------------------------


def test_a_teller_is_banned_at_its_third_false_report_within_ten_minutes() -> None:
    ledger = FalseReports()
    assert (ledger.limit, ledger.window_s) == (3, 600.0)
    assert ledger.add("liar", now=0.0) is False
    assert ledger.add("liar", now=100.0) is False
    assert ledger.count("liar", now=100.0) == 2
    assert ledger.add("liar", now=599.0) is True


def test_false_reports_older_than_the_window_are_forgiven() -> None:
    ledger = FalseReports()
    ledger.add("teller", now=0.0)
    ledger.add("teller", now=300.0)
    assert ledger.add("teller", now=600.0) is False  # the first one is 600 s old: gone
    assert ledger.count("teller", now=600.0) == 2
    assert ledger.add("teller", now=650.0) is True


def test_tellers_are_charged_apart_and_a_ban_starts_the_count_again() -> None:
    ledger = FalseReports(limit=2)
    assert ledger.add("a", now=0.0) is False
    assert ledger.add("b", now=1.0) is False
    assert ledger.add("a", now=2.0) is True
    assert ledger.count("a", now=2.0) == 0  # the ban's own backoff takes over
    assert ledger.count("b", now=2.0) == 1


def test_the_ledger_holds_a_bounded_number_of_tellers() -> None:
    ledger = FalseReports(max_tellers=3)
    for i in range(10):
        ledger.add(f"throwaway-{i}", now=float(i))
    assert sum(ledger.count(f"throwaway-{i}", now=10.0) for i in range(10)) == 3
    assert ledger.count("throwaway-9", now=10.0) == 1  # the newest are kept


def test_a_peer_that_served_is_vouched_for_within_the_window() -> None:
    ledger = FalseReports()
    assert ledger.vouched("p", now=0.0) is False
    ledger.served(["p", "q"], now=10.0)
    assert ledger.vouched("p", now=609.0) and ledger.vouched("q", now=609.0)
    assert ledger.vouched("p", now=610.0) is False  # 600 s since it last served
    ledger.served(["p"], now=605.0)
    assert ledger.vouched("p", now=1000.0) and not ledger.vouched("q", now=1000.0)


def test_the_served_ledger_is_bounded_and_keeps_the_latest() -> None:
    ledger = FalseReports(max_tellers=3)
    ledger.served(["old"], now=0.0)
    ledger.served([f"throwaway-{i}" for i in range(3)], now=1.0)
    assert not ledger.vouched("old", now=2.0)
    assert all(ledger.vouched(f"throwaway-{i}", now=2.0) for i in range(3))
    ledger.served(["throwaway-0"], now=3.0)  # served again: now the newest
    ledger.served(["new"], now=4.0)
    assert ledger.vouched("throwaway-0", now=5.0) and not ledger.vouched("throwaway-1", now=5.0)
