"""The wire codec: length-prefixed msgpack maps, with every limit a hostile peer tests."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import pytest

from swarmd.errors import (
    FrameBufferError,
    FrameError,
    FrameTooLargeError,
    MalformedFrameError,
    PeerError,
)
from swarmd.net.frames import FRAME_HEADER_BYTES, FrameDecoder, decode_body, encode_frame

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
