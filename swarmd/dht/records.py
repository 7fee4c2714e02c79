"""The signed record a node publishes on the DHT for each model it serves (pure, no I/O).

Wire format (a DHT value): one msgpack map, keys in the order of `NodeRecord`'s fields,
then ``"sig"``::

    {"peer_id": str, "model_id": str, ..., "expires_at": float, "seq": int, "sig": bin(64)}

``sig`` is the Ed25519 signature, by the key inside ``peer_id``, of
``RECORD_SIGNING_DOMAIN + msgpack(map of the fields without "sig")``. The value must be
exactly the canonical encoding that `sign_record` writes: a reordered map, a duplicate
key, a float32 or an over-wide integer is refused as malformed, so one record has one
encoding and a signed value cannot be re-encoded into a second valid one.

`decode_record` treats the value as hostile. Checks run cheapest first and the first
failure is raised: size (before any unpacking) -> msgpack with hard limits -> field set,
types (a bool is not an int) and ranges, read by the `RECORD_WIRE` schema with
`swarmd.untrusted`'s readers -> what spans fields -> canonical form -> expected owner and model ->
expiry -> signature. So a forged record that is also expired reports `ExpiredRecordError`.

DHT keys (py-libp2p's FIND_NODE refuses keys over 50 bytes, see shared/notes/libp2p.md)::

    record_key(model_id, peer_id) = "/swarmd/r/" + hex(sha256(RECORD_KEY_DOMAIN
                                        + lp(model_id) + lp(peer_id))[:16])   # 42 bytes
    model_key(model_id)           = "/swarmd/m/" + hex(sha256(MODEL_KEY_DOMAIN
                                        + lp(model_id))[:16])                 # 42 bytes

where ``lp(s)`` is the UTF-8 bytes of ``s`` preceded by their length as 4 big-endian
bytes. The namespace for a py-libp2p validator is ``swarmd``; a store validator should
use `decode_record_for_key`, which also checks that the key is the record's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack

from swarmd.errors import (
    BadSignatureError,
    ExpiredRecordError,
    MalformedRecordError,
    RecordError,
    RecordTooLargeError,
    WrongOwnerError,
)
from swarmd.model.layers import LayerRange
from swarmd.net.identity import Identity, public_key_from_peer_id, verify
from swarmd.untrusted import Bytes, Choice, Float, Int, List, Schema, Str, check_msgpack_budget

__all__ = [
    "KEY_NAMESPACE",
    "MAX_ADDRS",
    "MAX_LAYERS",
    "MAX_RECORD_BYTES",
    "MAX_SEQ",
    "MAX_TTL_S",
    "RECORD_SIGNING_DOMAIN",
    "STATES",
    "NodeRecord",
    "RecordStats",
    "decode_record",
    "decode_record_for_key",
    "length_prefixed",
    "model_key",
    "record_key",
    "sign_record",
    "unpack_value",
]

RECORD_SIGNING_DOMAIN = b"swarmd-record-v1\x00"
RECORD_KEY_DOMAIN = b"swarmd-record-key-v1\x00"
MODEL_KEY_DOMAIN = b"swarmd-model-key-v1\x00"
KEY_NAMESPACE = "swarmd"
_RECORD_KEY_PREFIX = "/swarmd/r/"
_MODEL_KEY_PREFIX = "/swarmd/m/"
_KEY_DIGEST_BYTES = 16  # 128 bits: 42-byte keys, well under libp2p's 50-byte limit

MAX_RECORD_BYTES = 4096
MAX_TTL_S = 3600.0  # a record may not claim to live longer than this from `now`
MAX_LAYERS = 10_000
MAX_ADDRS = 16
MAX_ADDR_CHARS = 256
MAX_ID_CHARS = 128  # peer_id, model_id, model_hash
MAX_SHORT_CHARS = 64  # dtype, weights, version
MAX_URL_CHARS = 256
MAX_KV_TOKENS = 1 << 40
MAX_SEQ = (1 << 63) - 1  # a msgpack int64: microseconds of wall time fit for 290,000 years
STATES = frozenset({"ready", "loading", "draining"})
_SIGNATURE_BYTES = 64
_HEX_DIGITS = frozenset("0123456789abcdef")

# Unpacker limits: nothing bigger than these is ever allocated, whatever a length claims.
_UNPACK_LIMITS: dict[str, Any] = {
    "max_str_len": 4 * MAX_ADDR_CHARS,  # bytes: a 256-char string may take 4 bytes/char
    "max_bin_len": _SIGNATURE_BYTES,
    "max_array_len": MAX_ADDRS,
    "max_map_len": 19,  # the 17 fields, the signature and one spare (named in errors)
    "max_ext_len": 0,
}


@dataclass(frozen=True)
class NodeRecord:
    """What one node serves of one model, as announced on the DHT."""

    peer_id: str  # the owner and signer (base58 libp2p peer id)
    model_id: str
    model_hash: str  # lowercase hex content id of the manifest; "" until manifests exist
    layer_start: int  # first layer served
    layer_end: int  # one past the last layer served
    num_layers: int  # layers in the whole model
    dtype: str  # what its matrix kernels compute in, e.g. "bfloat16"
    weights: str  # how its layer matrices are held, e.g. "int4" or "int4+int8"
    free_kv_tokens: int  # KV-cache tokens this node can still take
    kv_budget_tokens: int  # KV-cache tokens it holds in all (the longest session it takes)
    throughput_tps: float  # measured tokens/s through its layers
    state: str  # "ready" | "loading" | "draining"
    addrs: tuple[str, ...]  # multiaddrs the node listens on
    api_url: str  # its HTTP API, "" if not published
    version: str  # swarmd version
    expires_at: float  # unix seconds
    # Grows with every record the owner signs (`Discovery` sets it): of two records of
    # one owner and model the higher seq wins, so a captured older record (a "ready"
    # before a withdrawal) can never replace a newer one.
    seq: int = 0

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.layer_start, self.layer_end)

    def __post_init__(self) -> None:
        # Local convenience only: a list of addrs or an int number becomes the wire type.
        if isinstance(self.addrs, list):
            object.__setattr__(self, "addrs", tuple(self.addrs))
        for name in ("throughput_tps", "expires_at"):
            value = getattr(self, name)
            if type(value) is int:
                object.__setattr__(self, name, float(value))


_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(NodeRecord))


# --- keys -------------------------------------------------------------------------------


def length_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def record_key(model_id: str, peer_id: str) -> str:
    """The DHT key of `peer_id`'s record for `model_id` (42 ASCII bytes)."""
    named = length_prefixed(model_id) + length_prefixed(peer_id)
    digest = hashlib.sha256(RECORD_KEY_DOMAIN + named).digest()
    return _RECORD_KEY_PREFIX + digest[:_KEY_DIGEST_BYTES].hex()


def model_key(model_id: str) -> str:
    """The DHT key shared by every node serving `model_id` (42 ASCII bytes)."""
    digest = hashlib.sha256(MODEL_KEY_DOMAIN + length_prefixed(model_id)).digest()
    return _MODEL_KEY_PREFIX + digest[:_KEY_DIGEST_BYTES].hex()


# --- encoding ---------------------------------------------------------------------------


def _fields_map(record: NodeRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in _FIELDS}


def _signing_bytes(record: NodeRecord) -> bytes:
    return RECORD_SIGNING_DOMAIN + msgpack.packb(_fields_map(record), use_bin_type=True)


def _pack_wire(record: NodeRecord, signature: bytes) -> bytes:
    return msgpack.packb({**_fields_map(record), "sig": signature}, use_bin_type=True)


def sign_record(identity: Identity, record: NodeRecord) -> bytes:
    """The DHT value for `record`, signed by `identity`.

    Raises MalformedRecordError if the record would be refused by `decode_record` for its
    content (so a node never publishes what its peers drop), and WrongOwnerError if
    `record.peer_id` is not `identity`'s peer id. Expiry is not checked here.
    """
    _check_fields({**_fields_map(record), "addrs": list(record.addrs)})
    if record.peer_id != identity.peer_id:
        raise WrongOwnerError(
            f"cannot sign a record of peer {record.peer_id} with the key of {identity.peer_id}"
        )
    value = _pack_wire(record, identity.sign(_signing_bytes(record)))
    if len(value) > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"the record is {len(value)} bytes, over the {MAX_RECORD_BYTES}-byte limit"
        )
    return value


# --- validation -------------------------------------------------------------------------


# A record is one flat map; its longest field is the address list (16 addresses).
_MAX_RECORD_ITEMS = 256


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def _unpack(value: object) -> dict[str, Any]:
    return unpack_value(value, "record", MAX_RECORD_BYTES, _MAX_RECORD_ITEMS, 3, _UNPACK_LIMITS)


def unpack_value(
    value: object,
    what: str,
    max_bytes: int,
    max_items: int,
    max_depth: int,
    limits: dict[str, Any],
) -> dict[str, Any]:
    """A DHT value's msgpack, read with every limit (what it holds is checked after)."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise MalformedRecordError(f"the {what} is not bytes but {type(value).__name__}")
    size = value.nbytes if isinstance(value, memoryview) else len(value)
    if size > max_bytes:
        raise RecordTooLargeError(f"the {what} is {size} bytes, over {max_bytes}")
    # Counted before anything is built, as for every frame (untrusted.py).
    check_msgpack_budget(
        value, max_items=max_items, max_depth=max_depth, error=MalformedRecordError
    )
    try:
        obj = msgpack.unpackb(
            value,
            raw=False,
            strict_map_key=True,
            use_list=True,
            timestamp=0,
            ext_hook=_refuse_ext,
            **limits,
        )
    # msgpack signals every bad input as ValueError (ExtraData, FormatError, StackError,
    # UnicodeDecodeError and the limit checks are all ValueErrors); TypeError and
    # OverflowError cover what its docs call "other exceptions".
    except (ValueError, TypeError, OverflowError) as exc:
        raise MalformedRecordError(f"the {what} is not valid msgpack: {exc}") from exc
    return obj  # type: ignore[no-any-return]


def _text(max_chars: int, *, empty_ok: bool = False) -> Str:
    return Str(max_chars, min_chars=0 if empty_ok else 1, printable=True)


_COUNT = Int(0, MAX_KV_TOKENS)
# The record's fields in `NodeRecord`'s order, each with the bound it needs alone; what
# spans fields (layer_start < layer_end <= num_layers) and the peer id's key are checked
# in `_check_fields`. Floats are floats only: one record, one encoding.
RECORD_FIELDS = Schema(
    "record",
    (
        ("peer_id", _text(MAX_ID_CHARS)),
        ("model_id", _text(MAX_ID_CHARS)),
        ("model_hash", Str(MAX_ID_CHARS, alphabet=_HEX_DIGITS)),
        ("layer_start", Int(0, MAX_LAYERS - 1)),
        ("layer_end", Int(1, MAX_LAYERS)),
        ("num_layers", Int(1, MAX_LAYERS)),
        ("dtype", _text(MAX_SHORT_CHARS)),
        ("weights", _text(MAX_SHORT_CHARS)),
        ("free_kv_tokens", _COUNT),
        ("kv_budget_tokens", _COUNT),
        ("throughput_tps", Float(0.0, ints=False)),
        ("state", Choice(tuple(sorted(STATES)), "record state")),
        ("addrs", List(_text(MAX_ADDR_CHARS), MAX_ADDRS)),
        ("api_url", _text(MAX_URL_CHARS, empty_ok=True)),
        ("version", _text(MAX_SHORT_CHARS)),
        ("expires_at", Float(ints=False)),
        ("seq", Int(0, MAX_SEQ)),
    ),
)
# On the wire: the fields and their signature.
RECORD_WIRE = Schema(
    "record",
    (*RECORD_FIELDS.required, ("sig", Bytes(_SIGNATURE_BYTES, min_items=_SIGNATURE_BYTES))),
)


def _check_fields(fields: dict[str, Any], schema: Schema = RECORD_FIELDS) -> dict[str, Any]:
    """The fields read by `schema`, then what spans fields; raises MalformedRecordError."""
    read = schema.read(fields, MalformedRecordError)
    if public_key_from_peer_id(read["peer_id"]) is None:
        raise MalformedRecordError("record field peer_id is not an Ed25519 peer id")
    num_layers, start, end = read["num_layers"], read["layer_start"], read["layer_end"]
    if not start < end <= num_layers:
        raise MalformedRecordError(
            f"record layers {start}:{end} are not a range within its {num_layers} layers"
        )
    for i, addr in enumerate(read["addrs"]):
        if not addr.startswith("/"):
            raise MalformedRecordError(f"record field addrs[{i}] is not a multiaddr")
    return read


def decode_record(
    value: bytes,
    now: float,
    expected_peer_id: str | None = None,
    expected_model_id: str | None = None,
) -> NodeRecord:
    """The record in a DHT value, after every check; raises a `RecordError` subclass.

    `now` is the current unix time. `expected_peer_id` / `expected_model_id`, when given,
    are what the caller asked for (the owner it looked up, the model it wants); a valid
    record for anyone or anything else raises WrongOwnerError.
    """
    fields = _check_fields(_unpack(value), RECORD_WIRE)
    signature = fields.pop("sig")
    record = NodeRecord(**{**fields, "addrs": tuple(fields["addrs"])})
    if _pack_wire(record, signature) != bytes(value):
        raise MalformedRecordError("the record is not in canonical form")
    if expected_peer_id is not None and record.peer_id != expected_peer_id:
        raise WrongOwnerError(f"the record is of peer {record.peer_id}, not {expected_peer_id}")
    if expected_model_id is not None and record.model_id != expected_model_id:
        raise WrongOwnerError(
            f"the record is for model {record.model_id!r}, not {expected_model_id!r}"
        )
    if record.expires_at <= now:
        raise ExpiredRecordError(f"the record of {record.peer_id} expired")
    if record.expires_at > now + MAX_TTL_S:
        raise MalformedRecordError(
            f"the record of {record.peer_id} expires over {MAX_TTL_S:.0f} s from now"
        )
    if not verify(record.peer_id, _signing_bytes(record), signature):
        raise BadSignatureError(f"the record's signature is not by {record.peer_id}")
    return record


def decode_record_for_key(key: str, value: bytes, now: float) -> NodeRecord:
    """`decode_record` for a value found at (or offered for) DHT `key`.

    The record must be the one `key` names: ``record_key(record.model_id, record.peer_id)
    == key``, else WrongOwnerError. This is the check for a py-libp2p store validator.
    """
    record = decode_record(value, now)
    if record_key(record.model_id, record.peer_id) != key:
        raise WrongOwnerError(
            f"the record of {record.peer_id} for {record.model_id!r} does not belong at {key!r}"
        )
    return record


# --- counters ---------------------------------------------------------------------------


class RecordStats:
    """Accepted and rejected record counts, the rejections by `RecordError.reason`."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected: dict[str, int] = {}

    def accept(self) -> None:
        self.accepted += 1

    def reject(self, error: RecordError) -> None:
        self.rejected[error.reason] = self.rejected.get(error.reason, 0) + 1

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, int]:
        """``{"accepted": n, "rejected_<reason>": n, ...}`` with reasons sorted."""
        out = {"accepted": self.accepted}
        out.update({f"rejected_{r}": n for r, n in sorted(self.rejected.items())})
        return out
