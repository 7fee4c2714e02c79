"""Typed readers of untrusted values: each checks its type and bound, never lets a bool
pass as a number, and raises the caller's error type naming the field."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import pytest

from swarmd.errors import MalformedFrameError, MalformedRecordError
from swarmd.untrusted import (
    Bool,
    Bytes,
    Choice,
    Fields,
    Float,
    Int,
    List,
    Map,
    Nullable,
    Raw,
    Schema,
    Str,
    Struct,
    Tuple,
)

BAD = MalformedFrameError


def refused(reader: Any, value: object, match: str) -> None:
    with pytest.raises(BAD, match=match):
        reader.read(value, "f", BAD)


# --- scalars ----------------------------------------------------------------------------


def test_int_reads_ints_in_its_bounds_only() -> None:
    assert Int(0, 10).read(10, "f", BAD) == 10
    assert Int().read(-(2**70), "f", BAD) == -(2**70)  # no bound: any int
    assert Int(lo=5).read(2**64, "f", BAD) == 2**64
    for value in (11, -1, True, False, 1.0, "1", None, [1]):
        refused(Int(0, 10), value, r"'f' is not an integer in 0\.\.10")
    refused(Int(hi=3), 4, r"\.\.3")


def test_float_reads_numbers_as_floats_never_bools() -> None:
    got = Float(0.0, 1.0).read(1, "f", BAD)
    assert got == 1.0 and type(got) is float
    for value in (True, False, "0.5", None, 1.5, -0.1, math.nan, math.inf):
        refused(Float(0.0, 1.0), value, "'f' is not a number in")
    refused(Float(), math.inf, "finite number")
    refused(Float(), math.nan, "finite number")
    refused(Float(), 10**400, "finite number")  # an int past float's range
    assert Float(finite=False).read(math.inf, "f", BAD) == math.inf
    refused(Float(lo=0.0, finite=False), math.nan, "number in")  # NaN fails any bound


def test_bool_is_only_a_bool() -> None:
    assert Bool().read(True, "f", BAD) is True
    assert Bool().read(False, "f", BAD) is False
    for value in (1, 0, 1.0, "true", None):
        refused(Bool(), value, "'f' is not a bool")


def test_str_bounds_its_length_printability_and_alphabet() -> None:
    assert Str(3).read("abc", "f", BAD) == "abc"
    assert Str(3).read("", "f", BAD) == ""
    refused(Str(3), "abcd", "0..3 characters")
    refused(Str(3, min_chars=1), "", "1..3 characters")
    refused(Str(3), b"ab", "string")
    refused(Str(3), 5, "string")
    refused(Str(20, printable=True), "a\nb", "do not print")
    refused(Str(20, printable=True), "\x1b[31m", "do not print")
    assert Str(20, printable=True).read("é ok", "f", BAD) == "é ok"
    digits = Str(5, alphabet=frozenset("0123456789"))
    assert digits.read("042", "f", BAD) == "042"
    refused(digits, "4a2", "alphabet")
    refused(digits, "\u0663", "alphabet")  # an Arabic-Indic digit is not ours


def test_bytes_are_bytes_of_whole_items_within_a_count() -> None:
    assert Bytes(4).read(b"abcd", "f", BAD) == b"abcd"
    refused(Bytes(4), b"abcde", "'f' is not bytes of at most 4")
    refused(Bytes(4), bytearray(2), "bytes")  # a bytearray is mutable: not what msgpack gives
    refused(Bytes(4), "ab", "bytes")
    ints = Bytes(2, item_size=4, what="int32")
    assert ints.read(b"\x00" * 8, "f", BAD) == b"\x00" * 8
    refused(ints, b"\x00" * 12, "int32 bytes of at most 2 items")
    refused(ints, b"\x00" * 6, "int32 bytes")


def test_choice_is_one_of_its_options_of_the_same_type() -> None:
    status = Choice((400, 413), "status")
    assert status.read(413, "f", BAD) == 413
    refused(status, 500, "'f' is not a status: one of 400, 413")
    refused(Choice((1, 0)), True, "one of")  # True == 1, but it is not the int 1
    refused(Choice(("a",)), ["a"], "one of")  # unhashable garbage is just refused
    assert Nullable(status).read(None, "f", BAD) is None
    refused(Nullable(status), 401, "status")


# --- containers -------------------------------------------------------------------------


def test_list_bounds_its_length_and_reads_each_item() -> None:
    small = List(Int(0, 9), max_len=3, min_len=1)
    assert small.read([1, 2, 3], "f", BAD) == [1, 2, 3]
    refused(small, [], r"list of 1\.\.3 items")
    refused(small, [1, 2, 3, 4], r"list of 1\.\.3 items")
    refused(small, (1, 2), "list")  # msgpack gives lists; a tuple is not one
    refused(small, [1, 10], "'f' is not an integer")
    refused(small, [1, True], "'f' is not an integer")
    assert List(Int(), None).read(list(range(5000)), "f", BAD)[-1] == 4999


def test_tuple_is_a_list_of_exactly_its_named_items() -> None:
    pair = Tuple((("token", Int(0)), ("value", Float())))
    assert pair.read([3, 1], "bias", BAD) == (3, 1.0)
    for value in ([3], [3, 1.0, 2.0], (3, 1.0), "3", None):
        refused(pair, value, r"is not \[token, value\]")
    with pytest.raises(BAD, match="'bias token'"):
        pair.read([-1, 1.0], "bias", BAD)
    with pytest.raises(BAD, match="'bias value'"):
        pair.read([1, math.nan], "bias", BAD)


def test_map_reads_keys_and_values_within_a_count() -> None:
    peers = Map(Str(4, min_chars=1), List(Str(10), 2), max_len=2)
    assert peers.read({"a": ["x"], "b": []}, "f", BAD) == {"a": ["x"], "b": []}
    refused(peers, {"a": [], "b": [], "c": []}, "at most 2 entries")
    refused(peers, {"": []}, "'f key'")
    refused(peers, {5: []}, "'f key'")
    refused(peers, {"a": ["x"] * 3}, "list")
    refused(peers, [["a", []]], "map")


# --- maps of declared fields ------------------------------------------------------------

POINT = Schema(
    "point",
    (("x", Int(0, 99)), ("y", Int(0, 99))),
    (("label", Str(10, printable=True)),),
)


def test_a_schema_reads_exactly_its_keys() -> None:
    assert POINT.read({"x": 1, "y": 2}, BAD) == {"x": 1, "y": 2}
    assert POINT.read({"x": 1, "y": 2, "label": "p"}, BAD) == {"x": 1, "y": 2, "label": "p"}
    with pytest.raises(BAD, match=r"point with wrong fields: \['y'\]"):
        POINT.read({"x": 1}, BAD)  # missing
    with pytest.raises(BAD, match=r"wrong fields: \['z'\]"):
        POINT.read({"x": 1, "y": 2, "z": 3}, BAD)  # unknown
    with pytest.raises(BAD, match=r"wrong fields: \['5'\]"):
        POINT.read({"x": 1, "y": 2, 5: 3}, BAD)  # a key that is not even a str
    with pytest.raises(BAD, match="'y' is not an integer"):
        POINT.read({"x": 1, "y": True}, BAD)
    with pytest.raises(BAD, match="'point' is not a map"):
        POINT.read([1, 2], BAD)


def test_a_schema_nests_and_names_the_error_type_it_was_given() -> None:
    outer = Schema("outer", (("p", Struct(POINT)),))
    assert outer.read({"p": {"x": 0, "y": 99}}, BAD) == {"p": {"x": 0, "y": 99}}
    with pytest.raises(MalformedRecordError, match="'y'"):
        outer.read({"p": {"x": 0, "y": 100}}, MalformedRecordError)


def test_a_schema_checks_what_a_builder_emits() -> None:
    assert POINT.check_keys({"x": 1, "y": 2}) == {"x": 1, "y": 2}
    assert POINT.keys == {"x", "y", "label"}
    with pytest.raises(ValueError, match="built with wrong fields"):
        POINT.check_keys({"x": 1})
    with pytest.raises(ValueError, match="built with wrong fields"):
        POINT.check_keys({"x": 1, "y": 2, "z": 3})


def test_fields_reads_one_key_at_a_time() -> None:
    raw = {"n": 3, "on": True, "w": 0.5, "s": "hi", "b": b"\x00", "l": [1, 2], "flag": 1}
    f = Fields(raw, "thing", BAD)
    assert f.int("n", 0, 5) == 3
    assert f.bool("on") is True
    assert f.float("w", 0.0, 1.0) == 0.5
    assert f.str("s", 2, printable=True) == "hi"
    assert f.bytes("b", 1) == b"\x00"
    assert f.list("l", 2, Int(0, 9)) == [1, 2]
    assert "n" in f and "zz" not in f
    with pytest.raises(BAD, match="'flag' is not a bool"):
        f.bool("flag")  # 1 is not True
    with pytest.raises(BAD, match="'on' is not an integer"):
        f.int("on", 0, 5)  # True is not 1
    with pytest.raises(BAD, match="'gone' is missing"):
        f.int("gone")
    with pytest.raises(BAD, match="'l' is not a list"):
        f.list("l", 1, Int())
    with pytest.raises(BAD, match="wrong fields"):
        f.exact_keys({"n", "on"}, {"w"})
    assert Fields({"n": 1}, "x", BAD).exact_keys({"n"}, {"w"}).int("n") == 1
    with pytest.raises(MalformedRecordError, match="'rec' is not a map"):
        Fields("nope", "rec", MalformedRecordError)


# --- what the other decoders (records, manifests, file RPC) need ----------------------


def test_float_can_refuse_ints_for_one_encoding() -> None:
    assert Float(0.0, ints=False).read(2.5, "f", BAD) == 2.5
    for value in (2, True, -1.0, math.nan):
        refused(Float(0.0, ints=False), value, "'f' is not a")
    refused(Float(ints=False), 7, "'f' is not a finite float")


def test_bytes_can_have_an_exact_length() -> None:
    sig = Bytes(64, min_items=64)
    assert sig.read(b"s" * 64, "f", BAD) == b"s" * 64
    for value in (b"s" * 63, b"s" * 65, b"", "s" * 64, bytearray(64)):
        refused(sig, value, "'f' is not bytes of exactly 64")
    refused(Bytes(8, min_items=2), b"x", r"bytes of 2\.\.8")


def test_str_with_a_pattern_and_a_name_for_what_it_must_be() -> None:
    hex64 = Str(64, min_chars=64, pattern=re.compile("[0-9a-f]{64}"), what="64 hex digits")
    assert hex64.read("a" * 64, "f", BAD) == "a" * 64
    # Every failure, the type's included, says what the value must be.
    for value in ("A" * 64, "a" * 63, "g" * 64, 64, None, ["a" * 64]):
        refused(hex64, value, "^'f' is not 64 hex digits$")
    refused(Str(9, pattern=re.compile("[a-z]+")), "a1", "does not match")
    assert Str(9, pattern=re.compile("[a-z]+")).read("ab", "f", BAD) == "ab"


def test_raw_leaves_a_value_for_code_to_check() -> None:
    config = {"a": [1, {"b": None}]}
    assert Raw(dict, "an object").read(config, "f", BAD) is config
    assert Raw().read(None, "f", BAD) is None
    for value in ([], "x", None, 1):
        refused(Raw(dict, "an object"), value, "^'f' is not an object$")


def test_wrong_fields_name_what_is_missing_and_what_is_unknown() -> None:
    with pytest.raises(BAD, match=r"missing \['y'\], unknown \['z'\]"):
        POINT.read({"x": 1, "z": 3}, BAD)


def test_the_error_may_be_any_callable_binding_more_than_the_message() -> None:
    error = functools.partial(MalformedFrameError, peer_id="12D3KooWpeer")
    with pytest.raises(MalformedFrameError, match="'y' is not an integer") as caught:
        POINT.read({"x": 1, "y": -1}, error)
    assert caught.value.peer_id == "12D3KooWpeer"
