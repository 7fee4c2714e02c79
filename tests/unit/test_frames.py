"""The wire codec: length-prefixed msgpack maps, with every limit a hostile peer tests,
the item and depth budget of a frame, and large bodies decoded off the event loop."""

from __future__ import annotations

import random
import threading
import time
import tracemalloc
from collections.abc import Callable
from types import SimpleNamespace

import msgpack
import pytest
import torch
import trio

from swarmd.errors import (
    FrameBudgetError,
    FrameBufferError,
    FrameError,
    FrameTooLargeError,
    MalformedFrameError,
    PeerError,
)
from swarmd.model.layers import LayerRange
from swarmd.model.sampling import SamplingParams
from swarmd.net import frames
from swarmd.net.frames import (
    FRAME_HEADER_BYTES,
    MAX_FRAME_DEPTH,
    MAX_FRAME_ITEMS,
    MAX_FRAME_STR_BYTES,
    THREAD_DECODE_BYTES,
    FrameDecoder,
    FrameStream,
    decode_body,
    encode_frame,
)
from swarmd.pipeline import wire
from swarmd.untrusted import check_msgpack_budget

MAX_FRAME = 1 << 20


def decoder(max_frame: int = MAX_FRAME, max_buffered: int | None = None) -> FrameDecoder:
    return FrameDecoder(max_frame, max_buffered or max_frame + FRAME_HEADER_BYTES + 65536)


def raw_frame(body: bytes) -> bytes:
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


SAMPLE = {
    "method": "forward",
    "args": {"session": "abc", "tokens": [1, 2, 3], "hidden": b"\x00\x01" * 300},
    "nested": {"ok": True, "x": 1.5, "none": None},
}


def test_round_trip() -> None:
    frame = encode_frame(SAMPLE)
    assert int.from_bytes(frame[:FRAME_HEADER_BYTES], "big") == len(frame) - FRAME_HEADER_BYTES
    assert decoder().feed(frame) == [SAMPLE]


def test_several_frames_in_one_feed_stay_in_order() -> None:
    frames = [{"i": i, "pad": "x" * i} for i in range(50)]
    assert decoder().feed(b"".join(encode_frame(f) for f in frames)) == frames


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64])
def test_split_across_many_partial_feeds(piece: int) -> None:
    frames = [SAMPLE, {"a": 1}, {"b": "y" * 1000}]
    encoded = [encode_frame(f) for f in frames]
    stream = b"".join(encoded)
    dec = decoder()
    got = []
    for start in range(0, len(stream), piece):
        got.extend(dec.feed(stream[start : start + piece]))
        assert dec.buffered_bytes < max(len(e) for e in encoded)  # never a whole frame held
    assert got == frames
    assert not dec.mid_frame


def test_mid_frame_tracks_a_partial_frame() -> None:
    frame = encode_frame({"a": 1})
    dec = decoder()
    assert not dec.mid_frame
    dec.feed(frame[:2])
    assert dec.mid_frame and dec.buffered_bytes == 2
    dec.feed(frame[2:-1])
    assert dec.mid_frame and dec.buffered_bytes == len(frame) - 1
    assert dec.feed(frame[-1:]) == [{"a": 1}]
    assert not dec.mid_frame and dec.buffered_bytes == 0


def test_oversized_declared_length_is_refused_from_the_header_alone() -> None:
    dec = decoder()
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLargeError, match="4294967295"):
            dec.feed(b"\xff\xff\xff\xff")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_oversized_declared_length_is_refused_before_its_body() -> None:
    dec = decoder(max_frame=1000)
    header = (1001).to_bytes(FRAME_HEADER_BYTES, "big")
    with pytest.raises(FrameTooLargeError):
        dec.feed(header[:3])  # not yet known: fine
        dec.feed(header[3:] + b"x" * 10)
    assert dec.buffered_bytes == 0  # nothing kept, not one body byte


def test_a_failed_decoder_stays_failed() -> None:
    dec = decoder(max_frame=1000)
    with pytest.raises(FrameTooLargeError):
        dec.feed(b"\x00\x01\x00\x00")
    with pytest.raises(FrameTooLargeError, match="already failed"):
        dec.feed(encode_frame({"a": 1}))


def test_msgpack_bomb_is_refused_fast_and_small() -> None:
    # A 4 GB str header inside a map inside a 20-byte frame.
    bomb = raw_frame(b"\x81\xa1a\xdb\xff\xff\xff\xff" + b"x" * 10)
    # A 4-billion-entry array and map, and a 4 GB bin, the same way.
    bombs = [
        bomb,
        raw_frame(b"\x81\xa1a\xdd\xff\xff\xff\xff"),
        raw_frame(b"\x81\xa1a\xdf\xff\xff\xff\xff"),
        raw_frame(b"\x81\xa1a\xc6\xff\xff\xff\xff" + b"x" * 10),
    ]
    for frame in bombs:
        tracemalloc.start()
        started = time.perf_counter()
        try:
            with pytest.raises(MalformedFrameError):
                decoder().feed(frame)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert time.perf_counter() - started < 0.5
        assert peak < 64 * 1024, f"{peak} bytes allocated for {frame!r}"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (msgpack.packb([1, 2, 3]), "array"),
        (msgpack.packb("text"), "str"),
        (msgpack.packb(7), "int"),
        (msgpack.packb(None), "nil"),
        (b"", "empty"),
        (msgpack.packb({1: "int key"}), "int map key"),
        (msgpack.packb({"a": msgpack.ExtType(5, b"abc")}), "ext type"),
        (msgpack.packb({"t": msgpack.Timestamp(1, 0)}), "timestamp ext"),
        (b"\x81\xa1a\xc7\x00\x05", "empty ext"),
        (msgpack.packb({"a": 1}) + b"\xc0", "trailing bytes"),
        (msgpack.packb({"a": "hello"})[:-2], "truncated body"),
        (b"\x81\xa1a\xa2\xff\xfe", "bad utf-8"),
        (b"\xc1", "reserved byte"),
        (b"\x91" * 5000 + b"\xc0", "nesting too deep"),
    ],
)
def test_non_dict_or_invalid_body_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(MalformedFrameError):
        decoder().feed(raw_frame(body))


def test_buffer_cap() -> None:
    dec = FrameDecoder(max_frame_bytes=100, max_buffered_bytes=200)
    frame = encode_frame({"p": "x" * 80})
    assert dec.feed(frame * 2) == [{"p": "x" * 80}] * 2  # 2 x 88 bytes: under the cap
    with pytest.raises(FrameBufferError):
        dec.feed(frame * 3)  # 264 bytes handed over at once


def test_buffer_cap_counts_the_partial_frame() -> None:
    dec = FrameDecoder(max_frame_bytes=100, max_buffered_bytes=110)
    frame = encode_frame({"p": "x" * 80})
    dec.feed(frame[:60])
    with pytest.raises(FrameBufferError):
        dec.feed(frame[60:] + frame[:30])  # 60 held + 58 new > 110


def test_decoder_limits_must_fit_a_frame() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_bytes=100, max_buffered_bytes=100)
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_bytes=0, max_buffered_bytes=100)


def test_encode_refuses_what_a_peer_would_refuse() -> None:
    with pytest.raises(MalformedFrameError):
        encode_frame([1, 2])  # type: ignore[arg-type]
    with pytest.raises(MalformedFrameError):
        encode_frame({"a": object()})
    with pytest.raises(FrameTooLargeError):
        encode_frame({"a": b"x" * 2000}, max_frame_bytes=1000)


def test_decode_body_accepts_bytes_keys_and_bin() -> None:
    assert decode_body(msgpack.packb({b"k": b"\x00"}, use_bin_type=True)) == {b"k": b"\x00"}


def test_frame_errors_belong_to_the_peer_branch() -> None:
    for cls in (FrameTooLargeError, FrameBufferError, MalformedFrameError):
        assert issubclass(cls, FrameError) and issubclass(cls, PeerError)


# --- the budget: items and depth per frame, not only per container -----------------------

MiB = 1 << 20
BIG_FRAME = 16 * MiB


def _array32(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big")


def _filled(unit: bytes, size: int = BIG_FRAME - 64) -> bytes:
    """{"a": [[unit x 4095], ...]}: every container within msgpack's per-container cap."""
    inner = b"\xdc" + (4095).to_bytes(2, "big") + unit * 4095
    count = size // len(inner)
    return b"\x81\xa1a" + _array32(count) + inner * count


WORST_CASES: dict[str, Callable[[], bytes]] = {
    "nested arrays": lambda: b"\x81\xa1a" + b"\x91" * (BIG_FRAME - 8) + b"\xc0",
    "empty arrays": lambda: _filled(b"\x90"),
    "empty maps": lambda: _filled(b"\x80"),
    "tiny ints": lambda: _filled(b"\x01"),
    "floats": lambda: _filled(b"\xcb" + b"\x00" * 8),
    "a huge array of nil": lambda: (
        b"\x81\xa1a" + _array32(BIG_FRAME - 16) + b"\xc0" * (BIG_FRAME - 16)
    ),
    "a 16 MiB str of emoji": lambda: msgpack.packb({"s": "\U0001f600" * (BIG_FRAME // 4 - 4)}),
}


def _feed_big(data: bytes) -> list[dict[str, object]]:
    return FrameDecoder(BIG_FRAME, BIG_FRAME + FRAME_HEADER_BYTES + 65536).feed(data)


@pytest.mark.parametrize("name", list(WORST_CASES))
def test_a_16_mib_frame_of_tiny_items_is_a_bad_frame_refused_fast_and_small(name: str) -> None:
    frame = raw_frame(WORST_CASES[name]())
    assert len(frame) <= BIG_FRAME + FRAME_HEADER_BYTES
    started = time.perf_counter()
    with pytest.raises(MalformedFrameError):
        _feed_big(frame)
    assert time.perf_counter() - started < 0.25  # measured: 12 ms at most (was seconds)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrameError):
            _feed_big(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * MiB  # was about 1 GB for the empty arrays


def test_items_are_counted_over_the_whole_frame() -> None:
    ok = {"a": [[7] * 4000 for _ in range(8)]}  # 32,000 ints + 8 lists + a key + the map
    body = msgpack.packb(ok)
    assert decode_body(body) == ok
    over = msgpack.packb({"a": [[7] * 4000 for _ in range(9)]})  # each list within 4,096
    with pytest.raises(FrameBudgetError, match="items"):
        decode_body(over)


def test_the_item_budget_is_exact() -> None:
    # The map, its key, the outer array, 8 inner arrays and their items: MAX_FRAME_ITEMS.
    def frame(last: int) -> dict[str, object]:
        return {"a": [[None] * 4095] * 7 + [[None] * last]}

    fits = frame(MAX_FRAME_ITEMS - 3 - 7 * 4096 - 1)
    assert _count(fits) == MAX_FRAME_ITEMS
    assert decode_body(msgpack.packb(fits)) == fits
    with pytest.raises(FrameBudgetError):
        decode_body(msgpack.packb(frame(MAX_FRAME_ITEMS - 3 - 7 * 4096)))


def _nested(depth: int) -> dict[str, object]:
    value: object = 1
    for _ in range(depth - 1):
        value = [value]
    return {"a": value}


def test_deep_nesting_is_refused_shallow_is_not() -> None:
    assert decode_body(msgpack.packb(_nested(MAX_FRAME_DEPTH))) == _nested(MAX_FRAME_DEPTH)
    for depth in (MAX_FRAME_DEPTH + 1, 100, 1000):
        with pytest.raises(FrameBudgetError, match="deep"):
            decoder().feed(encode_frame(_nested(depth)))
    with pytest.raises(FrameBudgetError):  # an empty container counts at its depth too
        decode_body(b"\x81\xa1a" + b"\x91" * (MAX_FRAME_DEPTH - 1) + b"\x90")


def test_a_budget_error_bans_like_any_malformed_frame() -> None:
    assert issubclass(FrameBudgetError, MalformedFrameError)


def test_a_long_str_is_refused_a_long_bin_is_not() -> None:
    with pytest.raises(MalformedFrameError):
        decode_body(msgpack.packb({"s": "x" * (MAX_FRAME_STR_BYTES + 1)}))
    blob = {"h": b"\x00" * (4 * MAX_FRAME_STR_BYTES)}
    assert decode_body(msgpack.packb(blob, use_bin_type=True)) == blob


def _count(obj: object) -> int:
    if isinstance(obj, dict):
        return 1 + sum(_count(k) + _count(v) for k, v in obj.items())
    if isinstance(obj, list):
        return 1 + sum(_count(x) for x in obj)
    return 1


def test_the_walk_counts_what_msgpack_decodes() -> None:
    rng = random.Random(5)
    scalars = [None, True, False, 0, -1, 127, 128, -33, 2**16, -(2**31), 2**64 - 1, -(2**63)]
    scalars += [1.5, "", "x" * 31, "y" * 32, "z" * 300, "é" * 200, b"", b"b" * 300]

    def value(depth: int) -> object:
        if depth > 3 or rng.random() < 0.4:
            return rng.choice(scalars)
        size = rng.choice((0, 1, 15, 16, 17, 300 if depth == 3 else 2))
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(size)]
        return {f"k{i}": value(depth + 1) for i in range(size)}

    long_ones = {"s": "é" * 40000, "b": b"c" * 70000, "a": [None] * 70000, "m": {}}
    long_ones["m"] = {f"k{i}": i for i in range(70000)}  # str32, bin32, array32, map32
    for obj in [long_ones, *({"v": value(1)} for _ in range(200))]:
        for single_float in (False, True):
            body = msgpack.packb(obj, use_bin_type=True, use_single_float=single_float)
            counted = check_msgpack_budget(
                body, max_items=10**9, max_depth=100, error=MalformedFrameError
            )
            assert counted == _count(obj)


@pytest.mark.parametrize(
    "body",
    [b"\x81\xa1a\xdc\x00", b"\x81\xa1a\xc5\x00", b"\x81\xa1a\xdb\x00\x00\x01", b"\x82\xa1a\xc0"],
)
def test_the_walk_refuses_cut_length_fields_as_malformed(body: bytes) -> None:
    with pytest.raises(MalformedFrameError):
        check_msgpack_budget(body, max_items=100, max_depth=4, error=MalformedFrameError)


# --- real frames fit the budget well ------------------------------------------------------

PEERS = [f"12D3KooW{i:044d}" for i in range(65)]
VOCAB = 50_000


def _longest_open() -> tuple[dict[str, object], wire.StageLimits]:
    route = tuple(wire.RouteHop(p, i, i + 1) for i, p in enumerate(PEERS[:64]))
    addrs = {
        p: tuple(f"/ip4/10.0.{i}.{j}/tcp/4001/p2p/{p}" for j in range(8))
        for i, p in enumerate(PEERS)
    }
    sampling = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        logit_bias={t: 1.5 for t in range(wire.MAX_LOGIT_BIAS)},
        seed=1,
    )
    history = tuple(range(1, VOCAB)) * 2  # ~100,000 reply tokens
    req = wire.OpenRequest("s", 0, route, addrs, PEERS[64], "m", 10**6, sampling, history)
    limits = wire.StageLimits(PEERS[0], "m", LayerRange(0, 1), 64, 4096, VOCAB, 10**6)
    return wire.open_frame(req), limits


def test_the_largest_real_open_frame_decodes_well_within_the_budget() -> None:
    frame, limits = _longest_open()
    body = encode_frame(frame, BIG_FRAME)[FRAME_HEADER_BYTES:]
    items = check_msgpack_budget(body, max_items=10**9, max_depth=100, error=MalformedFrameError)
    assert items * 4 < MAX_FRAME_ITEMS  # room to spare
    (got,) = _feed_big(encode_frame(frame, BIG_FRAME))
    req = wire.parse_open(got, limits)
    assert len(req.route) == 64 and len(req.history) == 2 * (VOCAB - 1)


def test_a_16_mib_step_frame_decodes_fast_and_within_64_mib() -> None:
    hidden = torch.zeros(1, wire.MAX_STEP_TOKENS, 8000, dtype=torch.bfloat16)
    frame = encode_frame(wire.step_frame(3, True, hidden, [1.0] * 63, 0), BIG_FRAME)
    assert len(frame) > 15.5 * MiB
    started = time.perf_counter()
    _feed_big(frame)
    assert time.perf_counter() - started < 0.25
    tracemalloc.start()
    try:
        (got,) = _feed_big(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * MiB
    assert got["shape"] == [wire.MAX_STEP_TOKENS, 8000] and len(got["h"]) == hidden.nbytes


# --- FrameStream: a large body is decoded off the event loop ------------------------------


class _FakeStream:
    """Just what FrameStream reads through: bytes out in 64 KiB reads, then EOF."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.muxed_conn = SimpleNamespace(peer_id="12D3KooWfake")

    def get_protocol(self) -> str:
        return "/test/1"

    async def read(self, n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        chunk, self._data = self._data[:n], self._data[n:]
        return chunk

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()


def test_frame_stream_decodes_a_large_body_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = {"a": 1}
    large = {"h": b"\x01" * THREAD_DECODE_BYTES}
    threads: list[tuple[int, threading.Thread]] = []
    real = frames.decode_body

    def spy(body: bytes | memoryview) -> dict[str, object]:
        threads.append((len(body), threading.current_thread()))
        return real(body)

    monkeypatch.setattr(frames, "decode_body", spy)
    data = encode_frame(small) + encode_frame(large, BIG_FRAME) + encode_frame(small)

    async def main() -> list[dict[str, object]]:
        stream = FrameStream(_FakeStream(data), max_frame_bytes=BIG_FRAME)  # type: ignore[arg-type]
        return [await stream.recv(5.0) for _ in range(3)]

    assert trio.run(main) == [small, large, small]
    on_loop = [size for size, thread in threads if thread is threading.main_thread()]
    off_loop = [size for size, thread in threads if thread is not threading.main_thread()]
    assert len(on_loop) == 2 and off_loop == [len(encode_frame(large, BIG_FRAME)) - 4]


def test_frame_stream_a_bad_large_body_breaks_the_stream() -> None:
    body = b"\x81\xa1a" + b"\x91" * THREAD_DECODE_BYTES + b"\xc0"

    async def main() -> None:
        stream = FrameStream(_FakeStream(raw_frame(body)), max_frame_bytes=BIG_FRAME)  # type: ignore[arg-type]
        with pytest.raises(FrameBudgetError) as caught:
            await stream.recv(5.0)
        assert caught.value.peer_id == "12D3KooWfake" and not stream.is_usable

    trio.run(main)
