"""The file RPC's requests and replies are read by their schemas (`swarmd.untrusted`):
a field of the wrong type or an extra key is a bad frame naming the peer that sent it."""

from __future__ import annotations

import pytest

from swarmd.errors import MalformedFrameError
from swarmd.model.manifest import MAX_CHUNK_BYTES
from swarmd.transfer.files import CHUNK_REQUEST, MANIFEST_REQUEST, _bad_frame, _bin

PEER = "12D3KooWholder"
CID = "ab" * 32


def test_a_reply_holds_its_one_bytes_field_and_nothing_else() -> None:
    assert _bin({"data": b"chunk"}, "data", PEER) == b"chunk"
    assert _bin({"manifest": b"{}"}, "manifest", PEER) == b"{}"
    for reply in ({}, {"data": "chunk"}, {"data": b"x", "more": 1}, {"manifest": b"x"}):
        with pytest.raises(MalformedFrameError) as caught:
            _bin(reply, "data", PEER)
        assert caught.value.peer_id == PEER


def test_a_chunk_reply_past_the_largest_chunk_is_a_bad_frame() -> None:
    with pytest.raises(MalformedFrameError, match="'data' is not bytes of at most"):
        _bin({"data": b"\x00" * (MAX_CHUNK_BYTES + 1)}, "data", PEER)


def test_requests_are_read_field_by_field() -> None:
    good = {"model": CID, "file": "a.bin", "index": 3}
    assert CHUNK_REQUEST.read(good, _bad_frame(PEER)) == good
    assert MANIFEST_REQUEST.read({"model": CID}, _bad_frame(PEER)) == {"model": CID}
    bad = [
        {**good, "index": True},  # a bool is not an index
        {**good, "index": -1},
        {**good, "file": 7},
        {**good, "file": "x" * 129},
        {**good, "model": None},
        {**good, "extra": 1},
        {"model": CID, "file": "a.bin"},
    ]
    for args in bad:
        with pytest.raises(MalformedFrameError) as caught:
            CHUNK_REQUEST.read(args, _bad_frame(PEER))
        assert caught.value.peer_id == PEER
    with pytest.raises(MalformedFrameError, match="wrong fields"):
        MANIFEST_REQUEST.read({"model": CID, "file": "a.bin"}, _bad_frame(PEER))
