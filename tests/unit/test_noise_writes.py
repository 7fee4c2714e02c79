"""Noise writes under cancellation: no message is lost after its nonce was spent.

Real Noise cipher states (an NN handshake in memory) over a fake socket whose writes wait
on a gate, so a test can cancel a writer at the exact moment py-libp2p used to lose one.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.security.noise.io import NoiseTransportReadWriter
from noise.connection import NoiseConnection

import swarmd.net.host  # noqa: F401  (applies the fix, as every node does)
from swarmd.net import noise_writes

PATTERN = b"Noise_NN_25519_ChaChaPoly_SHA256"


class GatedSocket:
    """A raw connection whose writes block until `gate` is set."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.wire: list[bytes] = []
        self.closed = False

    async def write(self, data: bytes) -> None:
        await self.gate.wait()
        self.wire.append(data)

    async def close(self) -> None:
        self.closed = True


def noise_pair() -> tuple[NoiseConnection, NoiseConnection]:
    sender = NoiseConnection.from_name(PATTERN)
    sender.set_as_initiator()
    sender.start_handshake()
    receiver = NoiseConnection.from_name(PATTERN)
    receiver.set_as_responder()
    receiver.start_handshake()
    receiver.read_message(sender.write_message())
    sender.read_message(receiver.write_message())
    return sender, receiver


def received(receiver: NoiseConnection, wire: list[bytes]) -> list[bytes]:
    """Decrypt every frame on the wire in order (a lost nonce makes this raise)."""
    return [bytes(receiver.decrypt(frame[2:])) for frame in wire]  # 2-byte length prefix


def run(test: object) -> None:
    async def main() -> None:
        with trio.fail_after(10):
            await test()  # type: ignore[operator]

    trio.run(main)


def test_the_fix_is_installed_once() -> None:
    write_msg = NoiseTransportReadWriter.write_msg
    assert getattr(write_msg, "_swarmd_cancel_safe", False)
    noise_writes.apply()
    assert NoiseTransportReadWriter.write_msg is write_msg


def test_a_writer_cancelled_mid_write_still_delivers_its_message() -> None:
    async def test() -> None:
        sender, receiver = noise_pair()
        sock = GatedSocket()
        conn = NoiseTransportReadWriter(sock, sender)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def cancelled_writer() -> None:
                with scope:
                    await conn.write_msg(b"first")

            nursery.start_soon(cancelled_writer)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()  # the write is past its encryption, waiting on the socket
            await trio.testing.wait_all_tasks_blocked()
            sock.gate.set()
        await conn.write_msg(b"second")
        assert received(receiver, sock.wire) == [b"first", b"second"]

    run(test)


def test_a_writer_cancelled_before_it_starts_spends_no_nonce() -> None:
    async def test() -> None:
        sender, receiver = noise_pair()
        sock = GatedSocket()
        sock.gate.set()
        conn = NoiseTransportReadWriter(sock, sender)  # type: ignore[arg-type]
        with trio.CancelScope() as scope:
            scope.cancel()
            await conn.write_msg(b"never")
        assert sock.wire == []
        await conn.write_msg(b"after")
        assert received(receiver, sock.wire) == [b"after"]

    run(test)


def test_a_write_past_its_deadline_closes_the_connection() -> None:
    async def test() -> None:
        sender, _ = noise_pair()
        sock = GatedSocket()  # never opens: the peer stopped reading
        write = noise_writes.cancel_safe(NoiseTransportReadWriter.write_msg.__wrapped__, 0.05)
        conn = NoiseTransportReadWriter(sock, sender)  # type: ignore[arg-type]
        with pytest.raises(trio.BrokenResourceError, match="not done in"):
            await write(conn, b"stuck")
        assert sock.closed
        with trio.fail_after(0.01):  # no second wait for a connection already broken
            with pytest.raises(trio.BrokenResourceError, match="already broken"):
                await write(conn, b"next")

    run(test)
