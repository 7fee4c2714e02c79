"""Frames on the wire: a 4-byte big-endian length, then a msgpack map.

The codec (`encode_frame`, `FrameDecoder`) is pure: no I/O, tested without sockets.
`FrameStream` wraps a libp2p stream (trio) with it: whole frames in and out, a timeout on
every read and write, typed errors for everything a peer can do wrong.

Everything that arrives is untrusted. The decoder refuses a frame from its header, before
reading the body, when the declared length is over `max_frame_bytes`; it never holds more
than `max_buffered_bytes`; and it unpacks with msgpack's own size limits set to the frame
size, so a header inside the body that declares a 4 GB string fails without allocating.
Ext types (including msgpack timestamps) and non-string map keys are refused.

A body is walked before it is decoded (`swarmd.untrusted`): over `MAX_FRAME_ITEMS`
items or `MAX_FRAME_DEPTH` nesting it is a bad frame, refused without building an object,
so a 16 MiB frame costs at most about 2x its size to decode and never a Python object per
byte. `FrameStream` decodes bodies of `THREAD_DECODE_BYTES` or more in a worker thread:
copying a 16 MiB tensor out of its frame takes milliseconds the event loop should not wait.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgpack
import trio

from swarmd.errors import (
    FrameBudgetError,
    FrameBufferError,
    FrameError,
    FrameTooLargeError,
    MalformedFrameError,
    RecvTimeoutError,
    SendTimeoutError,
    StreamClosedError,
)
from swarmd.net.quick_locks import QuickLock
from swarmd.untrusted import check_msgpack_budget

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from libp2p.abc import INetStream

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_SEND_TIMEOUT_S",
    "FRAME_HEADER_BYTES",
    "MAX_FRAME_DEPTH",
    "MAX_FRAME_ITEMS",
    "MAX_FRAME_STR_BYTES",
    "READ_CHUNK_BYTES",
    "THREAD_DECODE_BYTES",
    "FrameDecoder",
    "FrameStream",
    "Traffic",
    "decode_body",
    "encode_frame",
]

FRAME_HEADER_BYTES = 4
MAX_CONTAINER_ITEMS = 4096  # items in one msgpack array or map (tensors travel as bin)
# Items (scalars, containers and map keys) in one whole frame. The largest real frame is a
# stage `open` with every limit used (64 hops, 65 peers' addresses, 1,024 logit_bias
# pairs): about 4,000 items. At most ~200 bytes of Python objects each, and a 0.2 us walk.
MAX_FRAME_ITEMS = 32768
MAX_FRAME_DEPTH = 16  # real frames nest 4 deep (open -> sampling -> logit_bias -> pair)
# One str: real ones are ids, addresses and messages. CPython decodes UTF-8 into a buffer
# of 4 bytes per input byte before it shrinks it, so a 16 MiB str of emoji peaks at 64 MiB.
MAX_FRAME_STR_BYTES = 1024 * 1024
THREAD_DECODE_BYTES = 1024 * 1024
FRAME_MAX_DECLARABLE = 2 ** (8 * FRAME_HEADER_BYTES) - 1
DEFAULT_MAX_FRAME_BYTES = (
    16 * 1024 * 1024
)  # a 512-token prefill chunk of a 4096-wide model is 4 MiB
DEFAULT_SEND_TIMEOUT_S = 10.0
READ_CHUNK_BYTES = 64 * 1024  # yamux's largest data frame: one read never returns more
_T = TypeVar("_T")
_CLEANUP_TIMEOUT_S = 1.0  # close/reset are best effort: never wait longer for a broken link


# --- the pure codec ---------------------------------------------------------------------


def encode_frame(obj: dict[str, Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (header + msgpack body) of a dict; raises before anything is sent.

    Raises MalformedFrameError if `obj` is not a dict or holds something msgpack cannot
    encode, FrameTooLargeError if the body is longer than `max_frame_bytes`.
    """
    if not isinstance(obj, dict):
        raise MalformedFrameError(f"a frame body must be a dict, got {type(obj).__name__}")
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedFrameError(f"cannot encode frame: {exc}") from exc
    limit = min(max_frame_bytes, FRAME_MAX_DECLARABLE)
    if len(body) > limit:
        raise FrameTooLargeError(f"frame of {len(body)} bytes is over the {limit}-byte limit")
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


def _refuse_ext(code: int, data: bytes) -> object:
    raise MalformedFrameError(f"msgpack ext type {code} is not allowed in a frame")


def decode_body(
    body: bytes | bytearray | memoryview,
    max_items: int = MAX_FRAME_ITEMS,
    max_depth: int = MAX_FRAME_DEPTH,
) -> dict[str, Any]:
    """The dict in one frame body; MalformedFrameError for anything else.

    FrameBudgetError (a MalformedFrameError) for a body over `max_items` items or nested
    over `max_depth`, found before anything is built. msgpack's limits are set to the
    body's own length: no string, bytes, array or map inside it can declare more than the
    body holds, so nothing is allocated for a lie.
    """
    limit = len(body)
    if not limit or not (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):
        raise MalformedFrameError("frame body must be a msgpack map")
    check_msgpack_budget(
        body,
        max_items=max_items,
        max_depth=max_depth,
        error=MalformedFrameError,
        budget_error=FrameBudgetError,
    )
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=min(limit, MAX_FRAME_STR_BYTES),
            max_bin_len=limit,
            # Per container, not per frame: a cap well under the frame size keeps a frame
            # of nested empty arrays from growing 70x in memory.
            max_array_len=min(limit, MAX_CONTAINER_ITEMS),
            max_map_len=min(limit, MAX_CONTAINER_ITEMS),
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except MalformedFrameError:
        raise
    except (ValueError, TypeError) as exc:  # msgpack's errors (and bad UTF-8) are ValueErrors
        raise MalformedFrameError(f"frame body is not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise MalformedFrameError(f"frame body must be a map, got {type(obj).__name__}")
    return obj


class FrameDecoder:
    """Turns a byte stream, fed in pieces of any size, into frame dicts.

    After any FrameError the decoder is dead (framing is lost): every later `feed` raises.
    """

    def __init__(self, max_frame_bytes: int, max_buffered_bytes: int) -> None:
        if not 0 < max_frame_bytes <= FRAME_MAX_DECLARABLE:
            raise ValueError(f"max_frame_bytes must be in 1..{FRAME_MAX_DECLARABLE}")
        if max_buffered_bytes < max_frame_bytes + FRAME_HEADER_BYTES:
            raise ValueError("max_buffered_bytes must hold at least one whole frame")
        self._max_frame_bytes = max_frame_bytes
        self._max_buffered_bytes = max_buffered_bytes
        self._partial = bytearray()  # header bytes, then body bytes, of the frame in progress
        self._body_len: int | None = None  # known once the header is complete
        self._failed: FrameError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._partial) + (FRAME_HEADER_BYTES if self._body_len is not None else 0)

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has arrived: an end of stream now is a truncation."""
        return self.buffered_bytes > 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[dict[str, Any]]:
        """Add bytes; return every frame they complete, in order."""
        return self._guarded(lambda: [decode_body(body) for body in self._split(data)])

    def feed_bodies(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """Add bytes; return the body of every frame they complete, not yet decoded.

        For a caller that decodes elsewhere (`decode_body` in a worker thread); a body it
        finds bad is the caller's to handle. A returned memoryview is a slice of `data`:
        `data` must not change while it is in use.
        """
        return self._guarded(lambda: self._split(data))

    def _guarded(self, work: Callable[[], _T]) -> _T:
        if self._failed is not None:
            raise type(self._failed)(f"frame decoder already failed: {self._failed}")
        try:
            return work()
        except FrameError as exc:
            self._failed = exc
            self._partial = bytearray()  # framing is lost: keep nothing
            self._body_len = None
            raise

    def _split(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        view = memoryview(data).cast("B")
        held = self.buffered_bytes + len(view)
        if held > self._max_buffered_bytes:
            raise FrameBufferError(
                f"{held} bytes buffered, over the {self._max_buffered_bytes}-byte limit"
            )
        bodies: list[bytes | memoryview] = []
        while view:
            if self._body_len is None:
                take = FRAME_HEADER_BYTES - len(self._partial)
                self._partial += view[:take]
                view = view[take:]
                if len(self._partial) < FRAME_HEADER_BYTES:
                    break
                declared = int.from_bytes(self._partial, "big")
                if declared > self._max_frame_bytes:
                    raise FrameTooLargeError(
                        f"frame declares {declared} bytes, over the "
                        f"{self._max_frame_bytes}-byte limit"
                    )
                self._body_len = declared
                self._partial = bytearray()
            need = self._body_len - len(self._partial)
            if not self._partial and len(view) >= need:
                bodies.append(view[:need])  # whole body in this chunk: no copy
            else:
                self._partial += view[:need]
                if len(self._partial) < self._body_len:
                    break
                # Handed over, never written again: the next frame starts a new buffer.
                bodies.append(memoryview(self._partial))
                self._partial = bytearray()
            view = view[need:]
            self._body_len = None
        return bodies


# --- frames over a libp2p stream (trio) -------------------------------------------------


class _StreamErrors(NamedTuple):
    eof: type[BaseException]
    reset: type[BaseException]
    other: tuple[type[BaseException], ...]


@functools.cache
def _stream_errors() -> _StreamErrors:
    # Imported on first use, so the codec above loads without libp2p (a 1 s import that
    # also reconfigures logging).
    from libp2p.exceptions import BaseLibp2pError
    from libp2p.network.stream.exceptions import StreamEOF, StreamReset

    other = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)
    return _StreamErrors(StreamEOF, StreamReset, other)


class Traffic:
    """Bytes sent and received per protocol, over every frame stream of one host."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}

    def add_sent(self, protocol: str, size: int) -> None:
        self.sent[protocol] = self.sent.get(protocol, 0) + size

    def add_received(self, protocol: str, size: int) -> None:
        self.received[protocol] = self.received.get(protocol, 0) + size


async def _decode_off_loop(body: bytes | memoryview) -> dict[str, Any]:
    """`decode_body`, in a worker thread for a large body (its copies take milliseconds)."""
    if len(body) < THREAD_DECODE_BYTES:
        return decode_body(body)
    return await trio.to_thread.run_sync(decode_body, body)


class FrameStream:
    """Whole frames over one libp2p stream.

    A failed or interrupted read or write (timeout, cancellation, bad frame, reset) may
    leave half a frame on the wire, so it resets the stream: later calls raise
    StreamClosedError. An end of stream from the peer only ends reading; sending still
    works until `close`. Use as `async with`: a clean exit closes, an exception resets.
    """

    def __init__(
        self,
        stream: INetStream,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        traffic: Traffic | None = None,
    ) -> None:
        self._stream = stream
        self._traffic = traffic
        self._errors = _stream_errors()
        self._max_frame_bytes = max_frame_bytes
        self._send_timeout_s = send_timeout_s
        self._decoder = FrameDecoder(
            max_frame_bytes, max_frame_bytes + FRAME_HEADER_BYTES + READ_CHUNK_BYTES
        )
        self._ready: deque[dict[str, Any]] = deque()
        self._send_lock = QuickLock()  # no scheduler pass when free: a hop's latency
        self._recv_lock = QuickLock()
        self._recv_ended: str | None = None  # why reading is over (the peer ended it)
        self._broken: str | None = None  # why the whole stream is unusable
        self._closed = False
        self.peer_id = str(stream.muxed_conn.peer_id)
        self.protocol = str(stream.get_protocol())

    @property
    def is_usable(self) -> bool:
        return self._broken is None and not self._closed

    async def send(self, obj: dict[str, Any], timeout_s: float | None = None) -> None:
        """Write one frame; SendTimeoutError if the peer does not take it in time."""
        frame = encode_frame(obj, self._max_frame_bytes)
        self._check_open()
        timeout = self._send_timeout_s if timeout_s is None else timeout_s
        async with self._send_lock:
            self._check_open()
            try:
                with trio.fail_after(timeout):
                    await self._stream.write(frame)
                if self._traffic is not None:
                    self._traffic.add_sent(self.protocol, len(frame))
            except trio.TooSlowError:
                await self._break("send timed out")
                raise SendTimeoutError(
                    f"peer {self.peer_id[-8:]} did not take a {len(frame)}-byte frame "
                    f"in {timeout:g} s",
                    self.peer_id,
                ) from None
            except self._errors.other as exc:
                await self._break(f"write failed: {exc!r}")
                raise StreamClosedError(
                    f"stream to peer {self.peer_id[-8:]} failed while sending: {exc!r}",
                    self.peer_id,
                ) from exc
            except BaseException:  # cancelled mid-write: part of a frame may be out
                await self._break("send interrupted")
                raise

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        """Read one whole frame within `timeout_s` (math.inf: no limit of its own)."""
        async with self._recv_lock:
            if self._ready:
                return self._ready.popleft()
            self._check_open()
            if self._recv_ended is not None:
                raise StreamClosedError(self._recv_ended, self.peer_id)
            try:
                with trio.fail_after(timeout_s):
                    while not self._ready:
                        for body in self._decoder.feed_bodies(await self._read_chunk()):
                            self._ready.append(await _decode_off_loop(body))
            except trio.TooSlowError:
                await self._break("recv timed out")
                raise RecvTimeoutError(
                    f"no whole frame from peer {self.peer_id[-8:]} in {timeout_s:g} s",
                    self.peer_id,
                ) from None
            except FrameError as exc:
                exc.peer_id = self.peer_id
                await self._break(f"bad frame: {exc}")
                raise
            except StreamClosedError:
                raise
            except BaseException:  # cancelled mid-read: bytes may have been consumed
                await self._break("recv interrupted")
                raise
            return self._ready.popleft()

    async def _read_chunk(self) -> bytes:
        try:
            data = await self._stream.read(READ_CHUNK_BYTES)
        except self._errors.eof:
            data = b""
        except self._errors.reset as exc:
            await self._break("reset by the peer")
            raise StreamClosedError(
                f"stream reset by peer {self.peer_id[-8:]}", self.peer_id
            ) from exc
        except self._errors.other as exc:
            await self._break(f"read failed: {exc!r}")
            raise StreamClosedError(
                f"stream from peer {self.peer_id[-8:]} failed: {exc!r}", self.peer_id
            ) from exc
        if data:
            if self._traffic is not None:
                self._traffic.add_received(self.protocol, len(data))
            return data
        if self._decoder.mid_frame:
            await self._break("truncated frame")
            raise StreamClosedError(
                f"stream from peer {self.peer_id[-8:]} ended {self._decoder.buffered_bytes} "
                "bytes into a frame",
                self.peer_id,
                truncated=True,
            )
        self._recv_ended = f"stream closed by peer {self.peer_id[-8:]}"
        raise StreamClosedError(self._recv_ended, self.peer_id)

    def _check_open(self) -> None:
        if self._broken is not None:
            raise StreamClosedError(
                f"stream with peer {self.peer_id[-8:]} is unusable ({self._broken})",
                self.peer_id,
            )
        if self._closed:
            raise StreamClosedError("stream already closed", self.peer_id)

    async def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            await self._reset_stream()

    async def _reset_stream(self) -> None:
        # Already gone: nothing left to tell the peer.
        with (
            trio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True),
            contextlib.suppress(*self._errors.other),
        ):
            await self._stream.reset()

    async def close(self) -> None:
        """Finish sending (the peer reads an end of stream); reset if the stream is broken."""
        if self._closed:
            return
        self._closed = True
        if self._broken is not None:
            return  # reset already
        with trio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True) as scope:
            try:
                await self._stream.close()
            except self._errors.other:
                await self._reset_stream()
        if scope.cancelled_caught:
            await self._reset_stream()

    async def reset(self) -> None:
        """Abort the stream both ways (the peer's reads fail with a reset)."""
        self._closed = True
        if self._broken is None:
            self._broken = "reset locally"
            await self._reset_stream()

    async def __aenter__(self) -> FrameStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.reset()
