"""Checks of untrusted msgpack before it is decoded: a budget of items and depth.

msgpack's own limits are per container. A frame within them can still be costly: a
16 MiB body of empty arrays decodes to 16 million lists (about 1 GB, seconds of CPU).
`check_msgpack_budget` walks the type bytes of one msgpack value without building an
object (str, bin payloads skipped by their length) and refuses it, with the caller's
error type, when it holds more items or nests deeper than the budget, or is not well
formed enough to walk. The walk costs about 0.2 us per item and nothing per payload
byte, so it stops a hostile body after `max_items` steps whatever its size.

Once decoded, a peer's map is read field by field with typed readers (`Int`, `Float`,
`Bool`, `Str`, `Bytes`, `Choice`, `Nullable`, `List`, `Tuple`, `Map`, `Struct`, `Raw`), each a
small frozen declaration with its bound that checks one value and raises the caller's
error type naming the field. A `Schema` declares a whole map once (which keys, each
read how); `Fields` reads one map a key at a time for code that is not declared. Bools
are never ints here: msgpack gives Python bools and `True` must not pass as `1`.

Every decoder of peer data reads through here: the stage wire, frames, DHT records,
manifests and the file RPC. `error` is any callable from a message to an exception, so a
decoder can bind more (e.g. `functools.partial(MalformedFrameError, peer_id=peer)`).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "Bool",
    "Bytes",
    "Choice",
    "Fields",
    "Float",
    "Int",
    "List",
    "Map",
    "Nullable",
    "Raw",
    "Reader",
    "Schema",
    "Str",
    "Struct",
    "Tuple",
    "check_msgpack_budget",
]

_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from


def _fixed_sizes() -> tuple[int, ...]:
    """Bytes taken by each type byte that starts a scalar of fixed size; 0 for the rest."""
    sizes = [0] * 256
    for b in (*range(0x00, 0x80), *range(0xE0, 0x100)):  # positive and negative fixint
        sizes[b] = 1
    for b in range(0xA0, 0xC0):  # fixstr: the length is in the type byte
        sizes[b] = 1 + (b & 0x1F)
    scalars = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9}  # nil, false, true, floats
    scalars |= {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
    for b, size in scalars.items():
        sizes[b] = size
    return tuple(sizes)


_FIXED = _fixed_sizes()
_EXT_TYPES = frozenset((0xC7, 0xC8, 0xC9, *range(0xD4, 0xD9)))


def check_msgpack_budget(
    buf: bytes | bytearray | memoryview,
    *,
    max_items: int,
    max_depth: int,
    error: type[Exception],
    budget_error: type[Exception] | None = None,
) -> int:
    """The number of items (every scalar, container and map key) in one msgpack value.

    Raises `budget_error` (default: `error`) when `buf` holds more than `max_items` items
    or containers nested more than `max_depth` deep, and `error` for an ext type, a
    reserved byte, a truncated value or bytes after the value. Passing says nothing of
    str encodings or map key types: the decoder that runs next checks those.
    """
    over = budget_error or error
    end = len(buf)
    pos = 0
    items = 0
    remaining = 1  # items still to read in the innermost open container
    stack: list[int] = []  # the `remaining` of each enclosing container
    fixed = _FIXED
    try:
        while True:
            if not remaining:
                if not stack:
                    break
                remaining = stack.pop()
                continue
            remaining -= 1
            items += 1
            if pos >= end:
                raise error("msgpack value is truncated")
            b = buf[pos]
            size = fixed[b]
            if size:
                pos += size
                continue
            if 0x80 <= b <= 0x9F:  # fixmap, fixarray
                count = (b & 0x0F) * (2 if b <= 0x8F else 1)
                pos += 1
            elif b in (0xDC, 0xDE):  # array16, map16
                count = _U16(buf, pos + 1)[0] * (2 if b == 0xDE else 1)
                pos += 3
            elif b in (0xDD, 0xDF):  # array32, map32
                count = _U32(buf, pos + 1)[0] * (2 if b == 0xDF else 1)
                pos += 5
            elif b in (0xC4, 0xD9):  # bin8, str8
                pos += 2 + buf[pos + 1]
                continue
            elif b in (0xC5, 0xDA):  # bin16, str16
                pos += 3 + _U16(buf, pos + 1)[0]
                continue
            elif b in (0xC6, 0xDB):  # bin32, str32
                pos += 5 + _U32(buf, pos + 1)[0]
                continue
            elif b in _EXT_TYPES:
                raise error(f"msgpack ext type (byte {b:#04x}) is not allowed")
            else:
                raise error(f"msgpack reserved byte {b:#04x}")
            if len(stack) >= max_depth:
                raise over(f"msgpack nested over {max_depth} containers deep")
            if items + count > max_items:
                raise over(f"msgpack value of over {max_items} items")
            if count > end - pos:  # every item takes a byte at least
                raise error(f"msgpack container of {count} items in {end - pos} bytes")
            if count:
                stack.append(remaining)
                remaining = count
    except (IndexError, struct.error):  # a length field cut by the end of the buffer
        raise error("msgpack value is truncated") from None
    if pos > end:
        raise error("msgpack value is truncated")
    if pos < end:
        raise error(f"{end - pos} bytes after the msgpack value")
    return items


# --- typed readers of decoded values ----------------------------------------------------

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
Error = Callable[[str], Exception]
_MISSING: Any = object()


class Reader(Protocol[T_co]):
    """Checks one untrusted value: returns it (normalised) or raises `error`."""

    def read(self, value: Any, name: str, error: Error) -> T_co: ...


def _span(lo: float | None, hi: float | None) -> str:
    return f"{'' if lo is None else lo}..{'' if hi is None else hi}"


@dataclass(frozen=True)
class Int:
    """An int (never a bool) in `lo..hi`; None is no bound on that side."""

    lo: int | None = None
    hi: int | None = None

    def read(self, value: Any, name: str, error: Error) -> int:
        if (
            type(value) is not int
            or (self.lo is not None and value < self.lo)
            or (self.hi is not None and value > self.hi)
        ):
            raise error(f"'{name}' is not an integer in {_span(self.lo, self.hi)}")
        return value


@dataclass(frozen=True)
class Float:
    """A number (an int or a float, never a bool) in `lo..hi`, finite unless told; read
    as a float. `ints=False`: a float only (a signed record has one encoding)."""

    lo: float | None = None
    hi: float | None = None
    finite: bool = True
    ints: bool = True

    def read(self, value: Any, name: str, error: Error) -> float:
        if type(value) is int and self.ints:
            try:
                value = float(value)
            except OverflowError:  # an int past float's range (never from msgpack)
                value = None
        # NaN fails every comparison, so a bound on either side refuses it too.
        ok = (
            type(value) is float
            and (not self.finite or math.isfinite(value))
            and (self.lo is None or value >= self.lo)
            and (self.hi is None or value <= self.hi)
        )
        if not ok:
            if self.lo is None and self.hi is None:
                kind = "float" if not self.ints else "number"
                raise error(f"'{name}' is not a {'finite ' if self.finite else ''}{kind}")
            raise error(f"'{name}' is not a number in {_span(self.lo, self.hi)}")
        return value


@dataclass(frozen=True)
class Bool:
    def read(self, value: Any, name: str, error: Error) -> bool:
        if type(value) is not bool:
            raise error(f"'{name}' is not a bool")
        return value


@dataclass(frozen=True)
class Str:
    """A str of `min_chars..max_chars`; `printable`: no control or separator characters;
    `alphabet`: only these characters; `pattern`: matching it whole. `what`, when given,
    is what every error says the value is not (e.g. "a plain file name")."""

    max_chars: int
    min_chars: int = 0
    printable: bool = False
    alphabet: frozenset[str] | None = None
    pattern: re.Pattern[str] | None = None
    what: str = ""

    def read(self, value: Any, name: str, error: Error) -> str:
        ok = type(value) is str and self.min_chars <= len(value) <= self.max_chars
        if self.what and not (
            ok
            and (not self.printable or value.isprintable())
            and (self.alphabet is None or self.alphabet.issuperset(value))
            and (self.pattern is None or self.pattern.fullmatch(value))
        ):
            raise error(f"'{name}' is not {self.what}")
        if not ok:
            raise error(
                f"'{name}' is not a string of {self.min_chars}..{self.max_chars} characters"
            )
        if self.printable and not value.isprintable():
            raise error(f"'{name}' holds characters that do not print")
        if self.alphabet is not None and not self.alphabet.issuperset(value):
            raise error(f"'{name}' holds characters outside its alphabet")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise error(f"'{name}' does not match {self.pattern.pattern[:60]!r}")
        return value


@dataclass(frozen=True)
class Bytes:
    """bytes (not a bytearray) of `min_items..max_items` items of `item_size` bytes each;
    `what` names the items' type in the error (e.g. int32)."""

    max_items: int
    item_size: int = 1
    what: str = ""
    min_items: int = 0

    def read(self, value: Any, name: str, error: Error) -> bytes:
        size = self.item_size
        if (
            type(value) is not bytes
            or len(value) % size
            or not self.min_items <= len(value) // size <= self.max_items
        ):
            what = f"{self.what} " if self.what else ""
            unit = " items" if size > 1 else ""
            if not self.min_items:
                count = f"at most {self.max_items}"
            elif self.min_items == self.max_items:
                count = f"exactly {self.max_items}"
            else:
                count = f"{self.min_items}..{self.max_items}"
            raise error(f"'{name}' is not {what}bytes of {count}{unit}")
        return value


@dataclass(frozen=True)
class Choice(Generic[T]):
    """One of `options`, of the same type as the option it equals (True is not 1)."""

    options: tuple[T, ...]
    what: str = "known value"

    def read(self, value: Any, name: str, error: Error) -> T:
        for option in self.options:
            if type(value) is type(option) and value == option:
                return option
        shown = ", ".join(repr(o) for o in self.options[:8])
        raise error(f"'{name}' is not a {self.what}: one of {shown}")


@dataclass(frozen=True)
class Raw:
    """Any value of type `kind` (None: any value at all), left as it is for code to
    check: a field whose bound depends on another one (read it there with a reader)."""

    kind: type | None = None
    what: str = "of the right type"

    def read(self, value: Any, name: str, error: Error) -> Any:
        if self.kind is not None and type(value) is not self.kind:
            raise error(f"'{name}' is not {self.what}")
        return value


@dataclass(frozen=True)
class Nullable(Generic[T]):
    """None, or what `inner` reads."""

    inner: Reader[T]

    def read(self, value: Any, name: str, error: Error) -> T | None:
        return None if value is None else self.inner.read(value, name, error)


@dataclass(frozen=True)
class List(Generic[T]):
    """A list (not a tuple) of `min_len..max_len` items (None: no bound beyond the
    frame's own budget), each read by `item` under the list's name."""

    item: Reader[T]
    max_len: int | None
    min_len: int = 0

    def read(self, value: Any, name: str, error: Error) -> list[T]:
        if type(value) is not list or not (
            self.min_len <= len(value) and (self.max_len is None or len(value) <= self.max_len)
        ):
            raise error(
                f"'{name}' is not a list of {_span(self.min_len, self.max_len)} items"
                if self.max_len is not None or self.min_len
                else f"'{name}' is not a list of items"
            )
        return [self.item.read(v, name, error) for v in value]


@dataclass(frozen=True)
class Tuple:
    """A list of exactly these named items, e.g. [peer, start, end]; each item's error
    names it '<list> <item>'."""

    items: tuple[tuple[str, Reader[Any]], ...]

    def read(self, value: Any, name: str, error: Error) -> tuple[Any, ...]:
        if type(value) is not list or len(value) != len(self.items):
            raise error(f"'{name}' is not [{', '.join(n for n, _ in self.items)}]")
        return tuple(
            r.read(v, f"{name} {n}", error) for (n, r), v in zip(self.items, value, strict=True)
        )


@dataclass(frozen=True)
class Map(Generic[T]):
    """A map of at most `max_len` entries, keys read by `key`, values by `value`."""

    key: Reader[str]
    value: Reader[T]
    max_len: int

    def read(self, value: Any, name: str, error: Error) -> dict[str, T]:
        if type(value) is not dict or len(value) > self.max_len:
            raise error(f"'{name}' is not a map of at most {self.max_len} entries")
        return {
            self.key.read(k, f"{name} key", error): self.value.read(v, name, error)
            for k, v in value.items()
        }


@dataclass(frozen=True)
class Schema:
    """A map declared once: its required and optional keys, each with its reader.

    `read` refuses a value that is not a map or whose keys are not exactly these (a
    missing required key or any unknown key), then reads each present field in
    declaration order. `keys` is what a builder must emit."""

    what: str
    required: tuple[tuple[str, Reader[Any]], ...]
    optional: tuple[tuple[str, Reader[Any]], ...] = ()

    @functools.cached_property
    def keys(self) -> frozenset[str]:
        return frozenset(k for k, _ in (*self.required, *self.optional))

    @functools.cached_property
    def required_keys(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.required)

    def read(self, value: Any, error: Error) -> dict[str, Any]:
        fields = Fields(value, self.what, error)
        fields.exact_keys(self.required_keys, self.keys)
        return {k: fields.read(k, r) for k, r in (*self.required, *self.optional) if k in fields}

    def check_keys(self, frame: dict[str, Any]) -> dict[str, Any]:
        """For builders: `frame` has every required key and no undeclared one."""
        required = self.required_keys
        if not required <= frame.keys() <= self.keys:
            odd = sorted((required - frame.keys()) | (frame.keys() - self.keys))
            raise ValueError(f"{self.what} built with wrong fields: {odd}")
        return frame


@dataclass(frozen=True)
class Struct:
    """A nested map, read by its `Schema`."""

    schema: Schema

    def read(self, value: Any, name: str, error: Error) -> dict[str, Any]:
        return self.schema.read(value, error)


class Fields:
    """Typed reads of one untrusted map, a key at a time; every error is `error` and
    names the key. A missing key is an error of its own (see `exact_keys` to refuse
    unknown keys too)."""

    def __init__(self, value: Any, what: str, error: Error) -> None:
        if type(value) is not dict:
            raise error(f"'{what}' is not a map")
        self._map: dict[Any, Any] = value
        self.what = what
        self.error = error

    def __contains__(self, key: str) -> bool:
        return key in self._map

    def exact_keys(self, required: Iterable[str], optional: Iterable[str] = ()) -> Fields:
        """Refuses a missing required key or any key not declared."""
        need = set(required)
        allowed = need | set(optional)
        have = set(self._map)
        if not need <= have or not have <= allowed:
            missing = sorted(need - have)[:5]
            unknown = sorted(str(k)[:40] for k in have - allowed)[:5]
            odd = sorted((*missing, *unknown))[:5]
            raise self.error(
                f"{self.what} with wrong fields: {odd} (missing {missing}, unknown {unknown})"
            )
        return self

    def read(self, key: str, reader: Reader[T]) -> T:
        value = self._map.get(key, _MISSING)
        if value is _MISSING:
            raise self.error(f"'{key}' is missing")
        return reader.read(value, key, self.error)

    def int(self, key: str, lo: int | None = None, hi: int | None = None) -> int:
        return self.read(key, Int(lo, hi))

    def float(
        self, key: str, lo: float | None = None, hi: float | None = None, *, finite: bool = True
    ) -> float:
        return self.read(key, Float(lo, hi, finite))

    def bool(self, key: str) -> bool:
        return self.read(key, Bool())

    def str(self, key: str, max_chars: int, *, min_chars: int = 0, printable: bool = False) -> str:
        return self.read(key, Str(max_chars, min_chars, printable))

    def bytes(self, key: str, max_len: int) -> bytes:
        return self.read(key, Bytes(max_len))

    def list(self, key: str, max_len: int | None, item: Reader[T]) -> list[T]:
        return self.read(key, List(item, max_len))
