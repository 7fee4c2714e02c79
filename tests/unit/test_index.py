"""The swarm's model catalog: signed index records, their validator and the merge."""

from __future__ import annotations

import dataclasses
import math
import random

import msgpack
import pytest

from swarmd.dht.discovery import RecordValidator
from swarmd.dht.index import (
    INDEX_SIGNING_DOMAIN,
    MAX_INDEX_BYTES,
    MAX_INDEX_MODELS,
    MAX_SWARM_MODELS,
    IndexRecord,
    ModelEntry,
    catalog,
    catalog_key,
    decode_index,
    decode_index_for_key,
    index_key,
    is_index_key,
    sign_index,
)
from swarmd.dht.records import (
    MAX_TTL_S,
    RECORD_SIGNING_DOMAIN,
    NodeRecord,
    RecordStats,
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
    WrongOwnerError,
)
from swarmd.net.identity import Identity
from tests.unit.test_records import ALICE, NOW, repack, wire_fields
from tests.unit.test_records import resign as records_resign

BOB = Identity.from_seed(bytes(range(1, 33)))
SMOL = ModelEntry("smollm2-135m-instruct", "ab" * 32, 30, 8192)
TINY = ModelEntry("tiny", "", 4, 256)


def make_index(identity: Identity = ALICE, **changes: object) -> IndexRecord:
    base = IndexRecord(peer_id=identity.peer_id, models=(SMOL, TINY), expires_at=NOW + 60.0, seq=7)
    return dataclasses.replace(base, **changes)


def resign(fields: dict[str, object], identity: Identity = ALICE) -> bytes:
    """A value with `fields` (whatever they hold) and a valid index signature."""
    return records_resign(fields, identity, INDEX_SIGNING_DOMAIN)


# --- the happy path ---------------------------------------------------------------------


def test_round_trip() -> None:
    index = make_index()
    value = sign_index(ALICE, index)
    assert len(value) <= MAX_INDEX_BYTES
    decoded = decode_index(value, NOW, expected_peer_id=ALICE.peer_id)
    assert decoded == index
    assert type(decoded.models) is tuple and not decoded.withdrawn
    assert decode_index_for_key(index_key(ALICE.peer_id), value, NOW) == index


def test_withdrawal_and_local_conveniences_round_trip() -> None:
    index = make_index(models=[], expires_at=int(NOW) + 5)
    assert index.models == () and type(index.expires_at) is float
    decoded = decode_index(sign_index(ALICE, index), NOW)
    assert decoded == index and decoded.withdrawn


def test_value_is_a_plain_msgpack_map_in_wire_order() -> None:
    fields = wire_fields(sign_index(ALICE, make_index()))
    assert list(fields) == ["peer_id", "models", "expires_at", "seq", "sig"]
    assert fields["models"] == [[SMOL.model_id, SMOL.model_hash, 30, 8192], ["tiny", "", 4, 256]]
    assert len(fields["sig"]) == 64


def test_a_full_index_of_realistic_ids_fits() -> None:
    entries = tuple(
        ModelEntry(f"org/model-{i:02d}-instruct-q4", f"{i:02x}" * 32, 32, 131072)
        for i in range(MAX_INDEX_MODELS)
    )
    value = sign_index(ALICE, make_index(models=entries))
    assert decode_index(value, NOW).models == entries


# --- signatures, owners and keys --------------------------------------------------------


def test_signed_by_another_key_than_its_peer_id_is_a_bad_signature() -> None:
    forged = resign(wire_fields(sign_index(ALICE, make_index())), identity=BOB)
    with pytest.raises(BadSignatureError):
        decode_index(forged, NOW)
    with pytest.raises(BadSignatureError):
        decode_index_for_key(index_key(ALICE.peer_id), forged, NOW)


@pytest.mark.parametrize("name", ["peer_id", "models", "expires_at", "seq", "sig"])
def test_tampering_any_field_breaks_the_signature(name: str) -> None:
    fields = wire_fields(sign_index(ALICE, make_index()))
    tampered = {
        "peer_id": BOB.peer_id,
        "models": [[SMOL.model_id, SMOL.model_hash, 30, 8193], ["tiny", "", 4, 256]],
        "expires_at": NOW + 61.0,
        "seq": 8,
        "sig": bytes([fields["sig"][0] ^ 1]) + fields["sig"][1:],
    }[name]
    assert tampered != fields[name]
    fields[name] = tampered
    with pytest.raises(BadSignatureError):
        decode_index(repack(fields), NOW)


def test_signature_is_domain_separated_from_records_and_bare_bodies() -> None:
    fields = wire_fields(sign_index(ALICE, make_index()))
    body = repack({k: v for k, v in fields.items() if k != "sig"})
    for prefix in (b"", RECORD_SIGNING_DOMAIN):
        fields["sig"] = ALICE.sign(prefix + body)
        with pytest.raises(BadSignatureError):
            decode_index(repack(fields), NOW)


def test_valid_index_of_another_peer_is_wrong_owner() -> None:
    value = sign_index(BOB, make_index(BOB))
    assert decode_index(value, NOW).peer_id == BOB.peer_id
    with pytest.raises(WrongOwnerError):
        decode_index(value, NOW, expected_peer_id=ALICE.peer_id)


def test_decode_for_key_refuses_a_foreign_key() -> None:
    value = sign_index(ALICE, make_index())
    for key in (index_key(BOB.peer_id), catalog_key(), record_key("tiny", ALICE.peer_id)):
        with pytest.raises(WrongOwnerError):
            decode_index_for_key(key, value, NOW)


def test_sign_refuses_another_peers_index_and_what_peers_would_drop() -> None:
    with pytest.raises(WrongOwnerError):
        sign_index(BOB, make_index(ALICE))
    with pytest.raises(MalformedRecordError, match="twice"):
        sign_index(ALICE, make_index(models=(TINY, TINY)))
    with pytest.raises(MalformedRecordError, match="sorted"):
        sign_index(ALICE, make_index(models=(TINY, SMOL)))
    with pytest.raises(MalformedRecordError):
        sign_index(ALICE, make_index(models=(dataclasses.replace(TINY, num_layers=0),)))
    with pytest.raises(MalformedRecordError):
        sign_index(ALICE, make_index(models=(("tiny", "", 4, 256),)))  # not a ModelEntry
    with pytest.raises(MalformedRecordError):
        sign_index(ALICE, make_index(expires_at=math.nan))
    many = tuple(ModelEntry(f"m{i:02d}", "", 1, 1) for i in range(MAX_INDEX_MODELS + 1))
    with pytest.raises(MalformedRecordError):
        sign_index(ALICE, make_index(models=many))
    # Sixteen entries each of the longest id and hash: valid entries, too many bytes.
    huge = tuple(
        ModelEntry(f"{i:02d}" + "m" * 126, "f" * 128, 1, 1) for i in range(MAX_INDEX_MODELS)
    )
    with pytest.raises(RecordTooLargeError):
        sign_index(ALICE, make_index(models=huge))


def test_keys_are_short_distinct_and_stable() -> None:
    keys = {catalog_key(), index_key(ALICE.peer_id), index_key(BOB.peer_id), model_key("")}
    assert len(keys) == 4
    for key in keys:
        assert key.isascii() and len(key.encode()) == 42
    assert catalog_key().startswith("/swarmd/c/") and catalog_key() == catalog_key()
    assert index_key(ALICE.peer_id).startswith("/swarmd/i/")
    assert index_key(ALICE.peer_id) == index_key(ALICE.peer_id)
    assert is_index_key(index_key(BOB.peer_id))
    assert not any(
        is_index_key(k) for k in (catalog_key(), record_key("m", ALICE.peer_id), model_key("m"))
    )


# --- expiry -----------------------------------------------------------------------------


def test_expired() -> None:
    value = sign_index(ALICE, make_index(expires_at=NOW + 60.0))
    assert decode_index(value, NOW + 59.9).expires_at == NOW + 60.0
    for now in (NOW + 60.0, NOW + 1e6):
        with pytest.raises(ExpiredRecordError):
            decode_index(value, now)


def test_expiry_too_far_ahead_is_malformed() -> None:
    value = sign_index(ALICE, make_index(expires_at=NOW + MAX_TTL_S + 1.0))
    with pytest.raises(MalformedRecordError, match="expires over"):
        decode_index(value, NOW)
    assert decode_index(value, NOW + 1.0).peer_id == ALICE.peer_id


def test_a_forged_expired_index_reports_the_expiry_first() -> None:
    stale = wire_fields(sign_index(ALICE, make_index(expires_at=NOW - 1.0)))
    with pytest.raises(ExpiredRecordError):
        decode_index(resign(stale, identity=BOB), NOW)


# --- malformed values -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({1: 2}),
        msgpack.packb({"peer_id": ALICE.peer_id}),
        b"\xa3\xff\xfe\xfd",  # str with invalid UTF-8
        msgpack.packb(msgpack.ExtType(5, b"\x00")),
    ],
)
def test_not_an_index(value: bytes) -> None:
    with pytest.raises(MalformedRecordError):
        decode_index(value, NOW)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (b"\x91" * 4 + b"\xc0", "deep"),  # an index nests 3 deep (map, list, entry)
        (b"\xdc\x00\xc8" + b"\xc0" * 200, "items"),  # an index has ~91 items at most
    ],
)
def test_the_item_budget_refuses_before_unpacking(value: bytes, said: str) -> None:
    with pytest.raises(MalformedRecordError, match=said):
        decode_index(value, NOW)


@pytest.mark.parametrize(
    "value",
    [
        msgpack.packb({"peer_id": "a" * 513}),  # str over max_str_len
        msgpack.packb({"sig": b"s" * 65}),  # bin over max_bin_len
        msgpack.packb({"models": [["m", "", 1, 1]] * (MAX_INDEX_MODELS + 1)}),  # array
        msgpack.packb({f"k{i}": 0 for i in range(7)}),  # map over max_map_len
    ],
)
def test_unpacker_limits_refuse_before_field_checks(value: bytes) -> None:
    with pytest.raises(MalformedRecordError, match="not valid msgpack"):
        decode_index(value, NOW)


@pytest.mark.parametrize("value", [None, "text", 42, [b"x"]])
def test_not_bytes(value: object) -> None:
    with pytest.raises(MalformedRecordError):
        decode_index(value, NOW)  # type: ignore[arg-type]


def test_oversized_value_is_refused_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object, **kwargs: object) -> object:
        raise AssertionError("unpackb called on an oversized value")

    monkeypatch.setattr(msgpack, "unpackb", explode)
    for value in (b"\x00" * (MAX_INDEX_BYTES + 1), memoryview(b"\x00" * (MAX_INDEX_BYTES + 1))):
        with pytest.raises(RecordTooLargeError):
            decode_index(value, NOW)


def test_trailing_bytes_missing_and_extra_fields() -> None:
    value = sign_index(ALICE, make_index())
    with pytest.raises(MalformedRecordError):
        decode_index(value + b"\x00", NOW)
    fields = wire_fields(value)
    with pytest.raises(MalformedRecordError, match="seq"):
        decode_index(resign({k: v for k, v in fields.items() if k != "seq"}), NOW)
    with pytest.raises(MalformedRecordError, match="sig"):
        decode_index(repack({k: v for k, v in fields.items() if k != "sig"}), NOW)
    with pytest.raises(MalformedRecordError, match="extra"):
        decode_index(resign({**fields, "extra": 1}), NOW)


def entries(*rows: object) -> list[object]:
    return list(rows)


SMOL_ROW = [SMOL.model_id, SMOL.model_hash, 30, 8192]
BAD_FIELDS = [
    ("peer_id", ""),
    ("peer_id", "12D3KooWnotapeerid"),
    ("peer_id", 7),
    ("expires_at", int(NOW) + 60),  # an int where a float belongs
    ("expires_at", math.inf),
    ("expires_at", math.nan),
    ("expires_at", True),
    ("seq", -1),
    ("seq", True),
    ("seq", 1.0),
    ("seq", 2**63),
    ("sig", "x" * 64),
    ("sig", b"x" * 63),
    ("models", "smollm2"),
    ("models", {"smollm2": 1}),
    ("models", entries(SMOL_ROW[:3])),  # three items, not four
    ("models", entries([*SMOL_ROW, 1])),  # five
    ("models", entries({"model_id": "smollm2"})),
    ("models", entries(["", "", 1, 1])),  # model_id empty
    ("models", entries(["m" * 129, "", 1, 1])),
    ("models", entries(["line\nbreak", "", 1, 1])),
    ("models", entries(["tab\tid", "", 1, 1])),
    ("models", entries([b"bytes", "", 1, 1])),
    ("models", entries([7, "", 1, 1])),
    ("models", entries(["m", "ABCD", 1, 1])),  # hash not lowercase
    ("models", entries(["m", "xyz", 1, 1])),
    ("models", entries(["m", "a" * 129, 1, 1])),
    ("models", entries(["m", None, 1, 1])),
    ("models", entries(["m", "", 0, 1])),  # num_layers 1..10000
    ("models", entries(["m", "", 10_001, 1])),
    ("models", entries(["m", "", True, 1])),
    ("models", entries(["m", "", 4.0, 1])),
    ("models", entries(["m", "", "4", 1])),
    ("models", entries(["m", "", 4, 0])),  # context_length 1..2**31
    ("models", entries(["m", "", 4, 2**31 + 1])),
    ("models", entries(["m", "", 4, -1])),
    ("models", entries(["m", "", 4, False])),
    ("models", entries(["m", "", 4, 256.0])),
    ("models", entries(["tiny", "", 4, 256], ["tiny", "", 4, 256])),  # listed twice
    ("models", entries(["tiny", "", 4, 256], ["tiny", "ab", 4, 256])),  # one id, twice
    ("models", entries(["tiny", "", 4, 256], SMOL_ROW)),  # not sorted
    ("models", entries(*([f"m{i:02d}", "", 1, 1] for i in range(MAX_INDEX_MODELS + 1)))),
]


@pytest.mark.parametrize(("name", "bad"), BAD_FIELDS)
def test_bad_field_is_malformed_even_when_signed(name: str, bad: object) -> None:
    fields = wire_fields(sign_index(ALICE, make_index()))
    fields[name] = bad
    value = repack(fields) if name == "sig" else resign(fields)
    if len(value) > MAX_INDEX_BYTES:  # a case that must not hide behind the size check
        pytest.fail(f"test value for {name} is too large")
    with pytest.raises(MalformedRecordError):
        decode_index(value, NOW)


def test_the_largest_values_of_each_field_are_accepted() -> None:
    entry = ModelEntry("m" * 128, "f" * 128, 10_000, 2**31)
    index = make_index(models=(entry,), seq=2**63 - 1)
    assert decode_index(sign_index(ALICE, index), NOW) == index


def test_non_canonical_encodings_are_refused() -> None:
    value = sign_index(ALICE, make_index())
    fields = wire_fields(value)
    reordered = repack(dict(reversed(list(fields.items()))))
    as_float32 = msgpack.packb(fields, use_bin_type=True, use_single_float=True)
    assert value[0] == 0x85  # a fixmap of 5 entries
    duplicated = b"\x86" + value[1:] + msgpack.packb("seq") + msgpack.packb(7)
    # The same entry list as a wider array type than msgpack's shortest.
    models = msgpack.packb(fields["models"], use_bin_type=True)
    assert models[0] == 0x92
    wide = value.replace(models, b"\xdc\x00\x02" + models[1:], 1)
    for variant in (reordered, as_float32, duplicated, wide):
        assert variant != value
        with pytest.raises(MalformedRecordError, match="canonical"):
            decode_index(variant, NOW)


def test_fuzzed_values_only_raise_record_errors() -> None:
    rng = random.Random(4321)
    good = sign_index(ALICE, make_index())
    accepted = 0
    for _ in range(2000):
        value = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(value))
            op = rng.random()
            if op < 0.5:
                value[pos] = rng.randrange(256)
            elif op < 0.75:
                del value[pos : pos + rng.randint(1, 8)]
            else:
                value[pos:pos] = rng.randbytes(rng.randint(1, 8))
        if value == good:
            continue
        try:
            decode_index(bytes(value), NOW)
            accepted += 1
        except RecordError:
            pass
    assert accepted == 0


# --- the validator: index keys next to record keys --------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def node_record(identity: Identity = ALICE) -> NodeRecord:
    return NodeRecord(
        peer_id=identity.peer_id,
        model_id="tiny",
        model_hash="",
        layer_start=0,
        layer_end=4,
        num_layers=4,
        dtype="float32",
        weights="fp32",
        free_kv_tokens=0,
        kv_budget_tokens=64,
        throughput_tps=0.0,
        state="ready",
        addrs=(),
        api_url="",
        version="0.1.0",
        expires_at=NOW + 60.0,
    )


def test_validator_checks_each_key_as_what_its_prefix_says() -> None:
    stats = RecordStats()
    validator = RecordValidator(Clock(), stats)
    index_value = sign_index(ALICE, make_index())
    record_value = sign_record(ALICE, node_record())
    validator.validate(index_key(ALICE.peer_id), index_value)
    validator.validate(record_key("tiny", ALICE.peer_id), record_value)  # as before
    refused = [
        (index_key(ALICE.peer_id), record_value),  # a node record where an index belongs
        (record_key("tiny", ALICE.peer_id), index_value),  # and the reverse
        (index_key(BOB.peer_id), index_value),  # another peer's key
        (catalog_key(), index_value),  # the catalog key holds providers, no value
        (index_key(ALICE.peer_id), sign_index(ALICE, make_index(expires_at=NOW - 1.0))),
        (index_key(ALICE.peer_id), b"junk"),
    ]
    for key, value in refused:
        with pytest.raises(RecordError):
            validator.validate(key, value)
        assert not validator.is_valid(key, value)
    assert validator.is_valid(index_key(ALICE.peer_id), index_value)
    assert stats.accepted == 2 and stats.rejected_total == len(refused)
    assert stats.rejected == {"malformed": 4, "wrong_owner": 1, "expired": 1}


def test_validator_refuses_an_index_of_a_banned_owner() -> None:
    validator = RecordValidator(Clock(), admits=lambda peer_id: peer_id != ALICE.peer_id)
    with pytest.raises(WrongOwnerError, match="refused"):
        validator.validate(index_key(ALICE.peer_id), sign_index(ALICE, make_index()))
    validator.validate(index_key(BOB.peer_id), sign_index(BOB, make_index(BOB)))


def test_validator_selects_the_higher_seq_then_a_withdrawal_then_the_later_expiry() -> None:
    clock = Clock()
    validator = RecordValidator(clock)
    key = index_key(ALICE.peer_id)

    def value(**changes: object) -> bytes:
        return sign_index(ALICE, make_index(**changes))

    old = value(seq=1, expires_at=NOW + 600.0)
    new = value(seq=2, expires_at=NOW + 10.0, models=(TINY,))
    withdrawn = value(seq=3, models=(), expires_at=NOW + 5.0)
    again = value(seq=4, expires_at=NOW + 60.0)
    # The owner's later index wins, whatever its expiry or content.
    assert validator.select(key, [old, new]) == 1
    assert validator.select(key, [new, old]) == 0
    # A withdrawal beats every older value, and loses to a newer announcement.
    assert validator.select(key, [old, new, withdrawn]) == 2
    assert validator.select(key, [withdrawn, old]) == 0
    assert validator.select(key, [withdrawn, again]) == 1
    # Of equal seq: a withdrawal, then the later expiry.
    same_seq = value(seq=5, expires_at=NOW + 30.0)
    same_seq_later = value(seq=5, expires_at=NOW + 40.0)
    same_seq_gone = value(seq=5, models=(), expires_at=NOW + 1.0)
    assert validator.select(key, [same_seq_later, same_seq]) == 0
    assert validator.select(key, [same_seq, same_seq_later]) == 1
    assert validator.select(key, [same_seq_later, same_seq_gone]) == 1
    # Invalid values lose; a copy of what is stored is taken (libp2p: [stored, incoming]).
    assert validator.select(key, [b"junk", value(expires_at=NOW - 1.0), old]) == 2
    assert validator.select(key, [old, old]) == 1
    # An expired withdrawal no longer counts: the older, live index is the one left.
    clock.now = NOW + 6.0
    assert validator.select(key, [withdrawn, old]) == 1


# --- merging indexes into the catalog ---------------------------------------------------


PEERS = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 21)]


def index_of(peer_id: str, *models: ModelEntry, seq: int = 1) -> IndexRecord:
    return IndexRecord(peer_id, tuple(sorted(models, key=lambda m: m.model_id)), NOW + 60, seq)


def test_catalog_merges_ids_with_who_lists_them() -> None:
    smol_other = dataclasses.replace(SMOL, model_hash="cd" * 32)
    found = catalog(
        [
            index_of(PEERS[1], SMOL, TINY),
            index_of(PEERS[0], smol_other),
            index_of(PEERS[2]),  # a withdrawal lists nothing
        ]
    )
    assert [m.model_id for m in found] == [SMOL.model_id, "tiny"]
    smol, tiny = found
    assert smol.listed_by == tuple(sorted([(PEERS[1], SMOL), (PEERS[0], smol_other)]))
    assert smol.peers == tuple(sorted([PEERS[0], PEERS[1]]))
    assert smol.variants == (SMOL, smol_other)  # by hash
    assert tiny.listed_by == ((PEERS[1], TINY),) and tiny.variants == (TINY,)
    assert catalog([]) == []


def test_catalog_takes_each_peers_latest_index() -> None:
    older = index_of(PEERS[0], SMOL, TINY, seq=1)
    newer = index_of(PEERS[0], TINY, seq=2)
    gone = index_of(PEERS[0], seq=3)
    assert [m.model_id for m in catalog([older, newer])] == ["tiny"]
    assert [m.model_id for m in catalog([newer, older])] == ["tiny"]
    assert catalog([older, gone, newer]) == []


def test_catalog_keeps_at_most_the_limit_own_ids_first_then_the_most_listed() -> None:
    own, spammers, crowd = PEERS[0], PEERS[1:14], PEERS[14:17]
    made_up = [ModelEntry(f"spam-{i:03d}", "", 1, 1) for i in range(200)]
    indexes = [
        index_of(peer, *made_up[i * MAX_INDEX_MODELS : (i + 1) * MAX_INDEX_MODELS])
        for i, peer in enumerate(spammers)
    ]
    popular = ModelEntry("zz-popular", "", 1, 1)
    indexes += [index_of(peer, popular) for peer in crowd]
    indexes.append(index_of(own, ModelEntry("zzz-mine", "", 1, 1)))
    found = catalog(indexes, own_peer_id=own)
    ids = [m.model_id for m in found]
    assert len(ids) == MAX_SWARM_MODELS and ids == sorted(ids)
    assert "zzz-mine" in ids and "zz-popular" in ids
    assert ids[: MAX_SWARM_MODELS - 2] == [m.model_id for m in made_up[: MAX_SWARM_MODELS - 2]]
    # Without an own peer, the limit still holds, and a smaller one is kept too.
    assert len(catalog(indexes)) == MAX_SWARM_MODELS
    assert [m.model_id for m in catalog(indexes, own, limit=2)] == ["zz-popular", "zzz-mine"]
