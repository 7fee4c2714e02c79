"""Signed DHT records: round trip, every refusal typed, hostile bytes refused cheaply."""

from __future__ import annotations

import dataclasses
import math
import random
import time
import tracemalloc

import msgpack
import pytest

from swarmd.dht.records import (
    MAX_ADDRS,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    RECORD_SIGNING_DOMAIN,
    NodeRecord,
    RecordStats,
    decode_record,
    decode_record_for_key,
    model_key,
    record_key,
    sign_record,
)
from swarmd.errors import (
    BadSignatureError,
    ExpiredRecordError,
    MalformedRecordError,
    RecordError,
    RecordTooLargeError,
    SwarmError,
    WrongOwnerError,
)
from swarmd.net.identity import Identity

NOW = 1_700_000_000.0
ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(1, 33)))


def make_record(identity: Identity = ALICE, **changes: object) -> NodeRecord:
    base = NodeRecord(
        peer_id=identity.peer_id,
        model_id="smollm2-135m-instruct",
        model_hash="ab" * 32,
        layer_start=0,
        layer_end=15,
        num_layers=30,
        dtype="float16",
        weights="fp32",
        free_kv_tokens=8192,
        kv_budget_tokens=8192,
        throughput_tps=42.5,
        state="ready",
        addrs=("/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"),
        api_url="http://127.0.0.1:8800",
        version="0.1.0",
        expires_at=NOW + 60.0,
    )
    return dataclasses.replace(base, **changes)


def wire_fields(value: bytes) -> dict[str, object]:
    return msgpack.unpackb(value, raw=False)


def repack(fields: dict[str, object]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def resign(
    fields: dict[str, object], identity: Identity = ALICE, domain: bytes = RECORD_SIGNING_DOMAIN
) -> bytes:
    """A value with `fields` (whatever they hold) and a valid signature by `identity`."""
    body = {k: v for k, v in fields.items() if k != "sig"}
    sig = identity.sign(domain + repack(body))
    return repack({**body, "sig": sig})


# --- the happy path ---------------------------------------------------------------------


def test_round_trip() -> None:
    record = make_record()
    value = sign_record(ALICE, record)
    assert len(value) <= MAX_RECORD_BYTES
    decoded = decode_record(value, NOW, expected_peer_id=ALICE.peer_id)
    assert decoded == record
    assert type(decoded.addrs) is tuple
    assert decode_record(value, NOW, expected_model_id=record.model_id) == record


def test_round_trip_with_empty_optional_fields_and_no_addrs() -> None:
    record = make_record(model_hash="", api_url="", addrs=(), throughput_tps=0.0)
    assert decode_record(sign_record(ALICE, record), NOW) == record


def test_local_conveniences_are_normalised() -> None:
    record = make_record(addrs=["/ip4/1.2.3.4/tcp/1"], throughput_tps=7, expires_at=int(NOW) + 9)
    assert record.addrs == ("/ip4/1.2.3.4/tcp/1",)
    assert type(record.throughput_tps) is float and type(record.expires_at) is float
    assert decode_record(sign_record(ALICE, record), NOW) == record


def test_value_is_a_plain_msgpack_map_with_the_field_names() -> None:
    fields = wire_fields(sign_record(ALICE, make_record()))
    assert list(fields) == [f.name for f in dataclasses.fields(NodeRecord)] + ["sig"]
    assert len(fields["sig"]) == 64


# --- signatures and owners --------------------------------------------------------------


def test_signed_by_another_key_than_its_peer_id_is_a_bad_signature() -> None:
    # Bob signs a record that claims to be Alice's.
    fields = wire_fields(sign_record(ALICE, make_record()))
    forged = resign(fields, identity=BOB)
    with pytest.raises(BadSignatureError):
        decode_record(forged, NOW)
    with pytest.raises(BadSignatureError):
        decode_record(forged, NOW, expected_peer_id=ALICE.peer_id)


def test_valid_record_of_another_peer_is_wrong_owner() -> None:
    value = sign_record(BOB, make_record(BOB))
    assert decode_record(value, NOW).peer_id == BOB.peer_id
    with pytest.raises(WrongOwnerError):
        decode_record(value, NOW, expected_peer_id=ALICE.peer_id)


def test_valid_record_for_another_model_is_wrong_owner() -> None:
    value = sign_record(ALICE, make_record())
    with pytest.raises(WrongOwnerError):
        decode_record(value, NOW, expected_model_id="other-model")


def test_sign_refuses_a_record_of_another_peer() -> None:
    with pytest.raises(WrongOwnerError):
        sign_record(BOB, make_record(ALICE))


def test_sign_refuses_what_peers_would_drop() -> None:
    with pytest.raises(MalformedRecordError):
        sign_record(ALICE, make_record(layer_end=31))
    with pytest.raises(MalformedRecordError):
        sign_record(ALICE, make_record(addrs=("/ip4/1.2.3.4/tcp/1",) * (MAX_ADDRS + 1)))
    with pytest.raises(MalformedRecordError):
        sign_record(ALICE, make_record(throughput_tps=math.nan))
    with pytest.raises(RecordTooLargeError):
        sign_record(ALICE, make_record(addrs=tuple("/" + "x" * 255 for _ in range(MAX_ADDRS))))


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(NodeRecord)] + ["sig"])
def test_tampering_any_field_breaks_the_signature(name: str) -> None:
    fields = wire_fields(sign_record(ALICE, make_record()))
    tampered = {
        "peer_id": BOB.peer_id,
        "model_id": "smollm2-135m-instruct-x",
        "model_hash": "cd" * 32,
        "layer_start": 1,
        "layer_end": 16,
        "num_layers": 31,
        "dtype": "float32",
        "weights": "int4",
        "free_kv_tokens": 8193,
        "kv_budget_tokens": 8191,
        "throughput_tps": 42.25,
        "state": "loading",
        "addrs": ["/ip4/127.0.0.2/tcp/4001", "/ip6/::1/tcp/4001"],
        "api_url": "http://127.0.0.1:8801",
        "version": "0.1.1",
        "expires_at": NOW + 61.0,
        "seq": 2,
        "sig": bytes([fields["sig"][0] ^ 1]) + fields["sig"][1:],
    }[name]
    assert tampered != fields[name]
    fields[name] = tampered
    with pytest.raises(BadSignatureError):
        decode_record(repack(fields), NOW)


def test_signature_is_domain_separated() -> None:
    # A signature over the bare msgpack body (no domain prefix) is not accepted.
    fields = wire_fields(sign_record(ALICE, make_record()))
    body = {k: v for k, v in fields.items() if k != "sig"}
    fields["sig"] = ALICE.sign(repack(body))
    with pytest.raises(BadSignatureError):
        decode_record(repack(fields), NOW)


# --- expiry -----------------------------------------------------------------------------


def test_expired() -> None:
    value = sign_record(ALICE, make_record(expires_at=NOW + 60.0))
    assert decode_record(value, NOW + 59.9).expires_at == NOW + 60.0
    with pytest.raises(ExpiredRecordError):
        decode_record(value, NOW + 60.0)
    with pytest.raises(ExpiredRecordError):
        decode_record(value, NOW + 1e6)


def test_expiry_too_far_ahead_is_malformed() -> None:
    value = sign_record(ALICE, make_record(expires_at=NOW + MAX_TTL_S + 1.0))
    with pytest.raises(MalformedRecordError):
        decode_record(value, NOW)
    assert decode_record(value, NOW + 1.0).peer_id == ALICE.peer_id


# --- malformed values -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"not msgpack at all",
        b"\x93\x01\x02",  # truncated array
        msgpack.packb([1, 2, 3]),
        msgpack.packb("a string"),
        msgpack.packb({1: 2}),  # non-string map key
        msgpack.packb({"peer_id": ALICE.peer_id}),
        b"\xa3\xff\xfe\xfd",  # str with invalid UTF-8
    ],
)
def test_not_a_record(value: bytes) -> None:
    with pytest.raises(MalformedRecordError):
        decode_record(value, NOW)


@pytest.mark.parametrize("length", [0, 1, 8])
def test_ext_types_are_refused_by_the_unpacker(length: int) -> None:
    fields = wire_fields(sign_record(ALICE, make_record()))
    fields["dtype"] = msgpack.ExtType(5, b"\x00" * length)
    with pytest.raises(MalformedRecordError, match="ext type"):
        decode_record(repack(fields), NOW)
    with pytest.raises(MalformedRecordError, match="ext type"):
        decode_record(msgpack.packb(msgpack.ExtType(5, b"\x00" * length)), NOW)


@pytest.mark.parametrize("value", [None, "text", 42, [b"x"]])
def test_not_bytes(value: object) -> None:
    with pytest.raises(MalformedRecordError):
        decode_record(value, NOW)  # type: ignore[arg-type]


def test_trailing_bytes() -> None:
    with pytest.raises(MalformedRecordError):
        decode_record(sign_record(ALICE, make_record()) + b"\x00", NOW)


def test_missing_and_extra_fields() -> None:
    fields = wire_fields(sign_record(ALICE, make_record()))
    missing = {k: v for k, v in fields.items() if k != "dtype"}
    with pytest.raises(MalformedRecordError, match="dtype"):
        decode_record(resign(missing), NOW)
    with pytest.raises(MalformedRecordError, match="sig"):
        decode_record(repack({k: v for k, v in fields.items() if k != "sig"}), NOW)
    with pytest.raises(MalformedRecordError, match="extra_field"):
        decode_record(resign({**fields, "extra_field": 1}), NOW)


BAD_FIELDS = [
    ("layer_start", True),  # bool is not an int
    ("layer_end", False),
    ("num_layers", True),
    ("free_kv_tokens", True),
    ("layer_start", 1.0),
    ("layer_start", "0"),
    ("throughput_tps", 42),  # an int where a float belongs
    ("throughput_tps", True),
    ("throughput_tps", math.nan),
    ("throughput_tps", math.inf),
    ("throughput_tps", -1.0),
    ("expires_at", math.inf),
    ("expires_at", int(NOW) + 60),
    ("layer_start", -1),
    ("layer_start", 15),  # start == end
    ("layer_end", 31),  # end > num_layers
    ("num_layers", 10),  # end > num_layers
    ("num_layers", 0),
    ("num_layers", 10_001),
    ("free_kv_tokens", -1),
    ("kv_budget_tokens", -1),
    ("free_kv_tokens", 2**63),
    ("state", "serving"),
    ("state", ""),
    ("peer_id", ""),
    ("peer_id", "12D3KooWnotapeerid"),
    ("peer_id", "Qm" + "x" * 200),
    ("peer_id", 7),
    ("model_id", ""),
    ("model_id", "m" * 129),
    ("model_id", "line\nbreak"),
    ("model_id", b"bytes"),
    ("model_hash", "ABCD"),
    ("model_hash", "xyz"),
    ("dtype", ""),
    ("dtype", None),
    ("version", ""),
    ("api_url", "u" * 257),
    ("addrs", "/ip4/1.2.3.4/tcp/1"),
    ("addrs", [1]),
    ("addrs", [""]),
    ("addrs", ["ip4/1.2.3.4"]),
    ("addrs", ["/" + "a" * 256]),
    ("addrs", ["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)),
    ("addrs", {"a": 1}),
    ("sig", "x" * 64),
    ("sig", b"x" * 63),
    ("seq", -1),
    ("seq", True),
    ("seq", 1.0),
    ("seq", 2**63),
]


@pytest.mark.parametrize(("name", "bad"), BAD_FIELDS)
def test_bad_field_is_malformed_even_when_signed(name: str, bad: object) -> None:
    fields = wire_fields(sign_record(ALICE, make_record()))
    fields[name] = bad
    value = repack(fields) if name == "sig" else resign(fields)
    if len(value) > MAX_RECORD_BYTES:  # a case that must not hide behind the size check
        pytest.fail(f"test value for {name} is too large")
    with pytest.raises(MalformedRecordError):
        decode_record(value, NOW)


def test_non_canonical_encodings_are_refused() -> None:
    value = sign_record(ALICE, make_record())
    fields = wire_fields(value)
    # The same content, keys in another order.
    reordered = repack(dict(reversed(list(fields.items()))))
    # The same content, throughput as float32.
    as_float32 = msgpack.packb(fields, use_bin_type=True, use_single_float=True)
    # A duplicate key: a valid record followed by a second "state".
    assert value[:3] == b"\xde\x00\x12"  # a map of 18 entries
    duplicated = b"\xde\x00\x13" + value[3:] + msgpack.packb("state") + msgpack.packb("ready")
    for variant in (reordered, as_float32, duplicated):
        assert variant != value
        with pytest.raises(MalformedRecordError, match="canonical"):
            decode_record(variant, NOW)


# --- size limits and bombs --------------------------------------------------------------


def test_oversized_value_is_refused_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object, **kwargs: object) -> object:
        raise AssertionError("unpackb called on an oversized value")

    monkeypatch.setattr(msgpack, "unpackb", explode)
    with pytest.raises(RecordTooLargeError):
        decode_record(b"\x00" * (MAX_RECORD_BYTES + 1), NOW)
    with pytest.raises(RecordTooLargeError):
        decode_record(memoryview(b"\x00" * (MAX_RECORD_BYTES + 1)), NOW)


BOMBS = {
    "str32 of 4 GB": b"\xdb\xff\xff\xff\xff" + b"a" * 64,
    "bin32 of 4 GB": b"\xc6\xff\xff\xff\xff" + b"a" * 64,
    "array32 of 4 G items": b"\xdd\xff\xff\xff\xff" + b"\xc0" * 64,
    "map32 of 4 G pairs": b"\xdf\xff\xff\xff\xff" + b"\xa1a\xc0" * 20,
    "ext32 of 4 GB": b"\xc9\xff\xff\xff\xff\x05" + b"a" * 64,
    "4 GB string inside the record": b"\x81\xa7peer_id\xdb\xff\xff\xff\xff" + b"a" * 64,
    "deep nesting": b"\x91" * 4000 + b"\xc0",
    "16 arrays of 16 nils": b"\xdc\x00\x10" + (b"\xdc\x00\x10" + b"\xc0" * 16) * 16,
}


@pytest.mark.parametrize("bomb", list(BOMBS.values()), ids=list(BOMBS))
def test_msgpack_bomb_fails_fast_without_allocating(bomb: bytes) -> None:
    assert len(bomb) <= MAX_RECORD_BYTES
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(MalformedRecordError):
            decode_record(bomb, NOW)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding allocated {peak} bytes"
    assert elapsed < 0.5


@pytest.mark.parametrize(
    "value",
    [
        msgpack.packb({"peer_id": "a" * 1025}),  # str over max_str_len
        msgpack.packb({"sig": b"s" * 65}),  # bin over max_bin_len
        msgpack.packb({"addrs": ["/a"] * 17}),  # array over max_array_len
        msgpack.packb({f"k{i}": 0 for i in range(20)}),  # map over max_map_len
    ],
)
def test_unpacker_limits_refuse_before_field_checks(value: bytes) -> None:
    with pytest.raises(MalformedRecordError, match="not valid msgpack"):
        decode_record(value, NOW)


def test_fuzzed_values_only_raise_record_errors() -> None:
    rng = random.Random(1234)
    good = sign_record(ALICE, make_record())
    accepted = 0
    for _ in range(3000):
        value = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            pos = rng.randrange(len(value))
            if op < 0.5:
                value[pos] = rng.randrange(256)
            elif op < 0.75:
                del value[pos : pos + rng.randint(1, 8)]
            else:
                value[pos:pos] = rng.randbytes(rng.randint(1, 8))
        if value == good:
            continue
        try:
            decode_record(bytes(value), NOW)
            accepted += 1
        except RecordError:
            pass
    assert accepted == 0  # every mutation breaks the canonical form or the signature


# --- keys and counters ------------------------------------------------------------------


def test_keys_are_short_distinct_and_stable() -> None:
    long_model = "a-very-long-model-identifier-" * 4
    keys = {
        record_key("m", ALICE.peer_id),
        record_key("m", BOB.peer_id),
        record_key(long_model, ALICE.peer_id),
        model_key("m"),
        model_key(long_model),
        model_key("m\x00"),
    }
    assert len(keys) == 6
    for key in keys:
        assert key.isascii() and len(key.encode()) <= 50
        assert key.startswith("/swarmd/")
    assert record_key("m", ALICE.peer_id) == record_key("m", ALICE.peer_id)
    # Length-prefixed: moving a character between the two parts changes the key.
    assert record_key("ab", "c") != record_key("a", "bc")
    assert model_key("m") != record_key("m", "")


def test_decode_for_key_checks_the_key_is_the_records_own() -> None:
    record = make_record()
    value = sign_record(ALICE, record)
    assert decode_record_for_key(record_key(record.model_id, ALICE.peer_id), value, NOW) == record
    with pytest.raises(WrongOwnerError):
        decode_record_for_key(record_key(record.model_id, BOB.peer_id), value, NOW)
    with pytest.raises(WrongOwnerError):
        decode_record_for_key(model_key(record.model_id), value, NOW)


def test_errors_are_in_the_tree_and_counted_by_reason() -> None:
    stats = RecordStats()
    values = [
        sign_record(ALICE, make_record()),
        sign_record(ALICE, make_record()),
        b"x" * (MAX_RECORD_BYTES + 1),
        b"junk",
        sign_record(ALICE, make_record(expires_at=NOW - 1.0)),
    ]
    for value in values:
        try:
            decode_record(value, NOW)
        except RecordError as exc:
            assert isinstance(exc, SwarmError)
            stats.reject(exc)
        else:
            stats.accept()
    assert stats.as_dict() == {
        "accepted": 2,
        "rejected_expired": 1,
        "rejected_malformed": 1,
        "rejected_too_large": 1,
    }
    assert stats.rejected_total == 3


def test_seq_is_signed_and_round_trips() -> None:
    record = make_record(seq=1_700_000_000_123_456)
    assert decode_record(sign_record(ALICE, record), NOW) == record
    assert make_record().seq == 0  # a record made without one (Discovery sets it)


def test_a_record_of_many_tiny_items_is_refused_before_unpacking() -> None:
    # 4,000 one-byte items: under the size cap, but no record has that many fields.
    value = b"\x91" * 2000 + b"\xc0"  # [[[...[nil]...]]]: depth 2,000
    with pytest.raises(MalformedRecordError, match="deep"):
        decode_record(value, NOW)
    flat = b"\xdc\x0f\xa0" + b"\xc0" * 4000  # one array of 4,000 nils
    with pytest.raises(MalformedRecordError, match="items"):
        decode_record(flat, NOW)
