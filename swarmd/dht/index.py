"""The swarm's model catalog: each node's signed list of the models it serves (pure, no I/O).

A DHT key holds one value, so no single key can hold "the list" that many nodes write.
The catalog is the holders pattern of `records.py` one level up: every serving node
provides the one well-known `catalog_key()` and keeps its own signed `IndexRecord` at
``index_key(peer_id)``; a reader takes the providers of the catalog key, then each one's
index (`Discovery.models`), and merges them with `catalog`.

An index is only a hint of model ids. What says a node serves a model now is its signed
`NodeRecord`; a caller lists an id only while `holders(id)` finds one, so a forged or
stale entry shows nothing.

Wire format (a DHT value): one msgpack map, keys in this order::

    {"peer_id": str, "models": [[model_id, model_hash, num_layers, context_length], ...],
     "expires_at": float, "seq": int, "sig": bin(64)}

``sig`` is the Ed25519 signature, by the key inside ``peer_id``, of
``INDEX_SIGNING_DOMAIN + msgpack(map of the fields without "sig")`` (a domain of its own:
no record signature is ever a valid index signature, nor the reverse). The entries are
sorted by model id, each id once, at most MAX_INDEX_MODELS. An index with no entries is a
withdrawal: signed with a higher seq, it replaces the owner's earlier index everywhere.

`decode_index` treats the value as hostile, with the checks of `decode_record` in the same
order, cheapest first: size -> msgpack with hard limits -> field set, types and ranges
(`INDEX_WIRE`) -> entries sorted and unique -> canonical form -> expected owner ->
expiry -> signature.

DHT keys (42 ASCII bytes each; ``lp`` as in records.py)::

    catalog_key()      = "/swarmd/c/" + hex(sha256(CATALOG_KEY_DOMAIN)[:16])
    index_key(peer_id) = "/swarmd/i/" + hex(sha256(INDEX_KEY_DOMAIN + lp(peer_id))[:16])

Index values live in the "swarmd" namespace too; `RecordValidator` tells them from node
records by the key's prefix (`is_index_key`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmd.dht.records import (
    MAX_ID_CHARS,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_TTL_S,
    length_prefixed,
    unpack_value,
)
from swarmd.errors import (
    BadSignatureError,
    ExpiredRecordError,
    MalformedRecordError,
    RecordTooLargeError,
    WrongOwnerError,
)
from swarmd.net.identity import Identity, public_key_from_peer_id, verify
from swarmd.untrusted import Bytes, Float, Int, List, Schema, Str, Tuple

__all__ = [
    "INDEX_SIGNING_DOMAIN",
    "MAX_CONTEXT_TOKENS",
    "MAX_INDEX_BYTES",
    "MAX_INDEX_MODELS",
    "MAX_SWARM_MODELS",
    "CatalogModel",
    "IndexRecord",
    "ModelEntry",
    "catalog",
    "catalog_key",
    "decode_index",
    "decode_index_for_key",
    "index_key",
    "index_rank",
    "is_index_key",
    "sign_index",
]

INDEX_SIGNING_DOMAIN = b"swarmd-index-v1\x00"
INDEX_KEY_DOMAIN = b"swarmd-index-key-v1\x00"
CATALOG_KEY_DOMAIN = b"swarmd-catalog-key-v1\x00"
_INDEX_KEY_PREFIX = "/swarmd/i/"
_CATALOG_KEY_PREFIX = "/swarmd/c/"
_KEY_DIGEST_BYTES = 16  # as records.py: 42-byte keys, under libp2p's 50-byte limit

MAX_INDEX_BYTES = 4096  # about 30 entries of a 40-char id and a 64-digit hash would fit
MAX_INDEX_MODELS = 16  # entries in one node's index
MAX_SWARM_MODELS = 64  # distinct model ids `catalog` returns, whatever the indexes hold
MAX_CONTEXT_TOKENS = 1 << 31
_SIGNATURE_BYTES = 64
_HEX_DIGITS = frozenset("0123456789abcdef")
_FIELD_NAMES = ("peer_id", "models", "expires_at", "seq")

# Unpacker limits: nothing bigger than these is ever allocated, whatever a length claims.
_UNPACK_LIMITS: dict[str, Any] = {
    "max_str_len": 4 * MAX_ID_CHARS,  # bytes: a 128-char string may take 4 bytes/char
    "max_bin_len": _SIGNATURE_BYTES,
    "max_array_len": MAX_INDEX_MODELS,  # the entry list; an entry has 4 items
    "max_map_len": len(_FIELD_NAMES) + 2,  # the fields, the signature and one spare
    "max_ext_len": 0,
}
# The map (11 items with its keys) and 16 entries of 5 items each: 91; one index is flat
# past its entries (map -> list -> entry).
_MAX_INDEX_ITEMS = 128
_MAX_INDEX_DEPTH = 3


@dataclass(frozen=True)
class ModelEntry:
    """One model a node serves, as its index lists it."""

    model_id: str
    model_hash: str  # lowercase hex content id of the manifest; "" without one
    num_layers: int  # layers in the whole model
    context_length: int  # the longest sequence the model takes, in tokens


@dataclass(frozen=True)
class IndexRecord:
    """The models one node serves, as announced on the DHT; no models is a withdrawal."""

    peer_id: str  # the owner and signer (base58 libp2p peer id)
    models: tuple[ModelEntry, ...]  # sorted by model id, each id once
    expires_at: float  # unix seconds
    seq: int = 0  # grows with every index the owner signs: the higher one wins

    def __post_init__(self) -> None:
        # Local convenience only: a list of entries or an int expiry becomes the wire type.
        if isinstance(self.models, list):
            object.__setattr__(self, "models", tuple(self.models))
        if type(self.expires_at) is int:
            object.__setattr__(self, "expires_at", float(self.expires_at))

    @property
    def withdrawn(self) -> bool:
        return not self.models


# --- keys -------------------------------------------------------------------------------


_CATALOG_KEY = (
    _CATALOG_KEY_PREFIX + hashlib.sha256(CATALOG_KEY_DOMAIN).digest()[:_KEY_DIGEST_BYTES].hex()
)


def catalog_key() -> str:
    """The DHT key every node serving any model provides (42 ASCII bytes)."""
    return _CATALOG_KEY


def index_key(peer_id: str) -> str:
    """The DHT key of `peer_id`'s index (42 ASCII bytes)."""
    digest = hashlib.sha256(INDEX_KEY_DOMAIN + length_prefixed(peer_id)).digest()
    return _INDEX_KEY_PREFIX + digest[:_KEY_DIGEST_BYTES].hex()


def is_index_key(key: str) -> bool:
    """Whether a "swarmd" DHT key is an index's (else it is a node record's)."""
    return key.startswith(_INDEX_KEY_PREFIX)


# --- encoding ---------------------------------------------------------------------------


def _fields_map(index: IndexRecord) -> dict[str, Any]:
    return {
        "peer_id": index.peer_id,
        "models": [
            [m.model_id, m.model_hash, m.num_layers, m.context_length] for m in index.models
        ],
        "expires_at": index.expires_at,
        "seq": index.seq,
    }


def _signing_bytes(index: IndexRecord) -> bytes:
    return INDEX_SIGNING_DOMAIN + msgpack.packb(_fields_map(index), use_bin_type=True)


def _pack_wire(index: IndexRecord, signature: bytes) -> bytes:
    return msgpack.packb({**_fields_map(index), "sig": signature}, use_bin_type=True)


def sign_index(identity: Identity, index: IndexRecord) -> bytes:
    """The DHT value for `index`, signed by `identity`.

    Raises MalformedRecordError if the index would be refused by `decode_index` for its
    content (entries unsorted or listed twice included: sort them first), WrongOwnerError
    if `index.peer_id` is not `identity`'s, and RecordTooLargeError over MAX_INDEX_BYTES.
    Expiry is not checked here.
    """
    for i, entry in enumerate(index.models):
        if type(entry) is not ModelEntry:
            raise MalformedRecordError(f"index entry {i} is not a ModelEntry")
    _check_fields(_fields_map(index), INDEX_FIELDS)
    if index.peer_id != identity.peer_id:
        raise WrongOwnerError(
            f"cannot sign an index of peer {index.peer_id} with the key of {identity.peer_id}"
        )
    value = _pack_wire(index, identity.sign(_signing_bytes(index)))
    if len(value) > MAX_INDEX_BYTES:
        raise RecordTooLargeError(
            f"the index is {len(value)} bytes, over the {MAX_INDEX_BYTES}-byte limit"
        )
    return value


# --- validation -------------------------------------------------------------------------


def _unpack(value: object) -> dict[str, Any]:
    return unpack_value(
        value, "index", MAX_INDEX_BYTES, _MAX_INDEX_ITEMS, _MAX_INDEX_DEPTH, _UNPACK_LIMITS
    )


def _text(max_chars: int) -> Str:
    return Str(max_chars, min_chars=1, printable=True)


MODEL_ENTRY = Tuple(
    (
        ("model_id", _text(MAX_ID_CHARS)),
        ("model_hash", Str(MAX_ID_CHARS, alphabet=_HEX_DIGITS)),
        ("num_layers", Int(1, MAX_LAYERS)),
        ("context_length", Int(1, MAX_CONTEXT_TOKENS)),
    )
)
# The index's fields in wire order, each with the bound it needs alone; the entries'
# order and the peer id's key are checked in `_check_fields`. Floats are floats only.
INDEX_FIELDS = Schema(
    "index",
    (
        ("peer_id", _text(MAX_ID_CHARS)),
        ("models", List(MODEL_ENTRY, MAX_INDEX_MODELS)),
        ("expires_at", Float(ints=False)),
        ("seq", Int(0, MAX_SEQ)),
    ),
)
# On the wire: the fields and their signature.
INDEX_WIRE = Schema(
    "index",
    (*INDEX_FIELDS.required, ("sig", Bytes(_SIGNATURE_BYTES, min_items=_SIGNATURE_BYTES))),
)


def _check_fields(fields: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """The fields read by `schema`, then what spans entries; raises MalformedRecordError."""
    read = schema.read(fields, MalformedRecordError)
    if public_key_from_peer_id(read["peer_id"]) is None:
        raise MalformedRecordError("index field peer_id is not an Ed25519 peer id")
    ids = [entry[0] for entry in read["models"]]
    for i in range(1, len(ids)):
        # One order, so one encoding; and one entry per id, as one record per id.
        if ids[i - 1] == ids[i]:
            raise MalformedRecordError(f"index lists model {ids[i]!r} twice")
        if ids[i - 1] > ids[i]:
            raise MalformedRecordError(f"index entries are not sorted by model id (entry {i})")
    return read


def decode_index(value: bytes, now: float, expected_peer_id: str | None = None) -> IndexRecord:
    """The index in a DHT value, after every check; raises a `RecordError` subclass.

    `now` is the current unix time. `expected_peer_id`, when given, is the owner the
    caller looked up; a valid index of anyone else raises WrongOwnerError.
    """
    fields = _check_fields(_unpack(value), INDEX_WIRE)
    signature = fields.pop("sig")
    index = IndexRecord(
        peer_id=fields["peer_id"],
        models=tuple(ModelEntry(*entry) for entry in fields["models"]),
        expires_at=fields["expires_at"],
        seq=fields["seq"],
    )
    if _pack_wire(index, signature) != bytes(value):
        raise MalformedRecordError("the index is not in canonical form")
    if expected_peer_id is not None and index.peer_id != expected_peer_id:
        raise WrongOwnerError(f"the index is of peer {index.peer_id}, not {expected_peer_id}")
    if index.expires_at <= now:
        raise ExpiredRecordError(f"the index of {index.peer_id} expired")
    if index.expires_at > now + MAX_TTL_S:
        raise MalformedRecordError(
            f"the index of {index.peer_id} expires over {MAX_TTL_S:.0f} s from now"
        )
    if not verify(index.peer_id, _signing_bytes(index), signature):
        raise BadSignatureError(f"the index's signature is not by {index.peer_id}")
    return index


def decode_index_for_key(key: str, value: bytes, now: float) -> IndexRecord:
    """`decode_index` for a value found at (or offered for) DHT `key`.

    The index must be the one `key` names: ``index_key(index.peer_id) == key``, else
    WrongOwnerError. This is the check for a py-libp2p store validator.
    """
    index = decode_index(value, now)
    if index_key(index.peer_id) != key:
        raise WrongOwnerError(f"the index of {index.peer_id} does not belong at {key!r}")
    return index


def index_rank(index: IndexRecord, value: bytes) -> tuple[int, bool, float, bytes]:
    """How two valid values at one index key compare (the higher wins): the owner's
    later index (seq); of equal seq a withdrawal, then the later expiry; then the bytes,
    so every node picks the same one."""
    return (index.seq, index.withdrawn, index.expires_at, bytes(value))


# --- merging ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogModel:
    """One model id of the swarm's catalog and the indexes that list it."""

    model_id: str
    listed_by: tuple[tuple[str, ModelEntry], ...]  # (peer id, its entry), by peer id

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(peer for peer, _ in self.listed_by)

    @property
    def variants(self) -> tuple[ModelEntry, ...]:
        """The distinct entries (hash, layers, context) announced for this id, sorted."""
        return tuple(
            sorted(
                set(entry for _, entry in self.listed_by),
                key=lambda e: (e.model_hash, e.num_layers, e.context_length),
            )
        )


def catalog(
    indexes: Iterable[IndexRecord],
    own_peer_id: str | None = None,
    limit: int = MAX_SWARM_MODELS,
) -> list[CatalogModel]:
    """The model ids of these indexes, each with who lists it, sorted by id.

    Of two indexes of one peer the higher seq counts; withdrawals list nothing. At most
    `limit` ids are kept: those `own_peer_id` lists first (a node always sees its own),
    then those listed by the most peers, then by id. Indexes are hints that cost a peer
    nothing to make up, so the cap bounds what a caller then looks up per id.
    """
    latest: dict[str, IndexRecord] = {}
    for index in indexes:
        seen = latest.get(index.peer_id)
        if seen is None or index.seq > seen.seq:
            latest[index.peer_id] = index
    by_id: dict[str, list[tuple[str, ModelEntry]]] = {}
    for peer_id in sorted(latest):
        for entry in latest[peer_id].models:
            by_id.setdefault(entry.model_id, []).append((peer_id, entry))

    def rank(model_id: str) -> tuple[bool, int, str]:
        listed = by_id[model_id]
        own = own_peer_id is not None and any(p == own_peer_id for p, _ in listed)
        return (not own, -len(listed), model_id)

    kept = sorted(sorted(by_id, key=rank)[: max(limit, 0)])
    return [CatalogModel(model_id, tuple(by_id[model_id])) for model_id in kept]
