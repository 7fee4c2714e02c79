"""Two libp2p hosts on 127.0.0.1 in one trio run: connect, frames, remote calls, hostile input.

Every test runs trio directly and puts a deadline on the whole run; every host is opened
with `async with` and so closed, even when the test fails.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from swarmd.errors import (
    ConfigError,
    DialError,
    DialTimeoutError,
    InvalidRequestError,
    PeerError,
    RecvTimeoutError,
    RemoteError,
    RpcTimeoutError,
    SendTimeoutError,
    StreamClosedError,
)
from swarmd.net.frames import FRAME_HEADER_BYTES, FrameStream, encode_frame
from swarmd.net.host import HostConfig, P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.rpc import RPC_PROTOCOL, RpcService, call, call_ping
from tests.trio_run import run_trio

RUN_DEADLINE_S = 30.0
TEST_PROTOCOL = "/swarmd/test/1"


@dataclass
class Pair:
    a: P2PHost
    b: P2PHost
    rpc_a: RpcService
    rpc_b: RpcService
    id_a: Identity
    id_b: Identity


@asynccontextmanager
async def two_hosts(connect: bool = True) -> AsyncIterator[Pair]:
    id_a, id_b = Identity.generate(), Identity.generate()
    async with open_host(id_a, 0) as a, open_host(id_b, 0) as b:
        pair = Pair(a, b, RpcService(a), RpcService(b), id_a, id_b)
        if connect:
            assert await a.connect(b.addrs[0]) == b.peer_id
        yield pair


async def raw_stream(host: P2PHost, peer_id: str, protocol: str) -> INetStream:
    """A bare libp2p stream, to write bytes no FrameStream would."""
    return await host.libp2p.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])


def run(test: Callable[[], Awaitable[None]]) -> None:
    run_trio(test, RUN_DEADLINE_S)


def test_connect_by_multiaddr_and_ping() -> None:
    async def test() -> None:
        async with two_hosts(connect=False) as p:
            assert p.a.port > 0 and p.a.port != p.b.port
            assert p.b.addrs == [f"/ip4/127.0.0.1/tcp/{p.b.port}/p2p/{p.id_b.peer_id}"]
            assert await p.a.connect(p.b.addrs[0]) == p.id_b.peer_id
            assert p.b.peer_id in p.a.connected_peers()
            rtt_s = await call_ping(p.a, p.b.peer_id, timeout_s=5.0)
            assert 0 < rtt_s < 1.0
            print(f"ping RTT on loopback: {rtt_s * 1000:.2f} ms")
            # the other way round, on the same connection
            assert await call_ping(p.b, p.a.peer_id, timeout_s=5.0) < 1.0

    run(test)


def test_peer_id_is_the_identity_and_is_proven_to_the_remote() -> None:
    seen: list[str] = []

    async def whoami(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        seen.append(peer_id)
        return {"you": peer_id}

    async def test() -> None:
        async with two_hosts() as p:
            assert p.a.peer_id == p.id_a.peer_id == str(p.a.libp2p.get_id())
            assert p.a.short_id == p.id_a.peer_id[-8:]
            p.rpc_b.register("whoami", whoami)
            assert await call(p.a, p.b.peer_id, "whoami", {}, 5.0) == {"you": p.id_a.peer_id}
            assert seen == [p.id_a.peer_id]

    run(test)


def test_rpc_round_trip_with_a_large_payload() -> None:
    async def echo(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"echo": args}

    async def test() -> None:
        async with two_hosts() as p:
            p.rpc_b.register("echo", echo)
            args = {"text": "héllo", "n": [1, 2.5, None, True], "blob": bytes(range(256)) * 4096}
            assert await call(p.a, p.b.peer_id, "echo", args, 10.0) == {"echo": args}
            assert "echo" in p.rpc_b.methods and "ping" in p.rpc_b.methods

    run(test)


def test_remote_errors_arrive_typed_with_peer_and_method() -> None:
    async def refuse(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        raise InvalidRequestError("layer 99 is out of range", param="layer")

    async def crash(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("secret detail /home/user/.key")

    async def not_a_dict(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        return [1, 2]  # type: ignore[return-value]

    async def test() -> None:
        async with two_hosts() as p:
            p.rpc_b.register("refuse", refuse)
            p.rpc_b.register("crash", crash)
            p.rpc_b.register("not_a_dict", not_a_dict)

            with pytest.raises(RemoteError) as info:
                await call(p.a, p.b.peer_id, "refuse", {}, 5.0)
            err = info.value
            assert (err.peer_id, err.method) == (p.b.peer_id, "refuse")
            assert err.remote_type == "InvalidRequestError"
            assert err.remote_message == "layer 99 is out of range"
            assert p.b.short_id in str(err) and "refuse" in str(err)

            with pytest.raises(RemoteError) as info:
                await call(p.a, p.b.peer_id, "crash", {}, 5.0)
            assert info.value.remote_type == "InternalError"
            assert "secret" not in str(info.value) and "Traceback" not in str(info.value)

            with pytest.raises(RemoteError) as info:
                await call(p.a, p.b.peer_id, "not_a_dict", {}, 5.0)
            assert info.value.remote_type == "InternalError"

            with pytest.raises(RemoteError) as info:
                await call(p.a, p.b.peer_id, "no_such_method", {}, 5.0)
            assert info.value.remote_type == "UnknownMethodError"

            # the service keeps serving after all that
            assert await call_ping(p.a, p.b.peer_id) < 1.0

    run(test)


def test_rpc_timeout_names_peer_and_method() -> None:
    async def stall(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def test() -> None:
        async with two_hosts() as p:
            p.rpc_b.register("stall", stall, timeout_s=2.0)
            with pytest.raises(RpcTimeoutError) as info:
                await call(p.a, p.b.peer_id, "stall", {}, timeout_s=0.05)
            assert (info.value.peer_id, info.value.method) == (p.b.peer_id, "stall")
            assert "stall" in str(info.value) and p.b.short_id in str(info.value)
            assert await call_ping(p.a, p.b.peer_id) < 1.0

    run(test)


def test_handler_timeout_and_concurrency_cap_come_back_as_remote_errors() -> None:
    entered, release = trio.Event(), trio.Event()

    async def hold(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        entered.set()
        with trio.CancelScope(shield=True):  # deaf to its own timeout: keeps the only slot
            await release.wait()
        return {}

    async def stall(peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def test() -> None:
        async with two_hosts() as p:
            p.rpc_b.register("hold", hold, max_concurrency=1, timeout_s=0.2)
            p.rpc_b.register("stall", stall, timeout_s=0.1)

            with pytest.raises(RemoteError) as info:
                await call(p.a, p.b.peer_id, "stall", {}, 5.0)
            assert info.value.remote_type == "HandlerTimeoutError"

            async def first() -> None:
                # it ran past its limit too, unheard: a result or a HandlerTimeoutError
                with contextlib.suppress(RemoteError):
                    await call(p.a, p.b.peer_id, "hold", {}, 5.0)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await entered.wait()
                with pytest.raises(RemoteError) as info:
                    await call(p.a, p.b.peer_id, "hold", {}, 5.0)
                assert info.value.remote_type == "OverloadedError"
                release.set()

    run(test)


def test_a_tiny_connect_timeout_raises_dial_timeout() -> None:
    async def test() -> None:
        async with two_hosts(connect=False) as p:
            with pytest.raises(DialTimeoutError) as info:
                await p.a.connect(p.b.addrs[0], timeout_s=1e-6)
            assert info.value.peer_id == p.b.peer_id
            assert await p.a.connect(p.b.addrs[0]) == p.b.peer_id  # a normal one still works

    run(test)


def test_bad_addresses_raise_dial_errors() -> None:
    async def test() -> None:
        async with two_hosts(connect=False) as p:
            for bad in ("garbage", f"/ip4/127.0.0.1/tcp/{p.b.port}", p.a.addrs[0]):
                with pytest.raises(DialError):
                    await p.a.connect(bad)
            closed = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
            with pytest.raises(DialError, match="cannot connect"):
                await p.a.connect(closed)
            with pytest.raises(DialError):
                await p.a.open_stream("not-a-peer-id", RPC_PROTOCOL)

    run(test)


def test_a_tiny_recv_timeout_raises_and_the_stream_is_reset() -> None:
    async def silent(stream: FrameStream) -> None:
        await trio.sleep_forever()

    async def test() -> None:
        async with two_hosts() as p:
            p.b.set_handler(TEST_PROTOCOL, silent)
            async with await p.a.open_stream(p.b.peer_id, TEST_PROTOCOL) as stream:
                with pytest.raises(RecvTimeoutError) as info:
                    await stream.recv(timeout_s=0.05)
                assert info.value.peer_id == p.b.peer_id
                assert not stream.is_usable
                with pytest.raises(StreamClosedError):
                    await stream.send({"after": "timeout"})

    run(test)


def test_a_tiny_open_stream_timeout_raises_dial_timeout() -> None:
    async def test() -> None:
        async with two_hosts() as p:
            with pytest.raises(DialTimeoutError) as info:
                await p.a.open_stream(p.b.peer_id, RPC_PROTOCOL, timeout_s=1e-6)
            assert info.value.peer_id == p.b.peer_id
            assert await call_ping(p.a, p.b.peer_id) < 1.0

    run(test)


def test_a_peer_that_stops_reading_raises_send_timeout() -> None:
    async def deaf(stream: FrameStream) -> None:
        await trio.sleep_forever()  # never reads: yamux's window fills up

    async def test() -> None:
        async with two_hosts() as p:
            p.b.set_handler(TEST_PROTOCOL, deaf)
            async with await p.a.open_stream(p.b.peer_id, TEST_PROTOCOL) as stream:
                big = {"blob": b"x" * (4 << 20)}  # far over yamux's 256 KiB window
                with pytest.raises(SendTimeoutError) as info:
                    await stream.send(big, timeout_s=0.3)
                assert info.value.peer_id == p.b.peer_id
                assert not stream.is_usable

    run(test)


def test_frames_in_both_directions_and_a_clean_end_of_stream() -> None:
    async def doubler(stream: FrameStream) -> None:
        while True:
            try:
                frame = await stream.recv(timeout_s=5.0)
            except StreamClosedError:
                return
            await stream.send({"n": frame["n"] * 2})

    async def test() -> None:
        async with two_hosts() as p:
            p.b.set_handler(TEST_PROTOCOL, doubler)
            async with await p.a.open_stream(p.b.peer_id, TEST_PROTOCOL) as stream:
                assert stream.peer_id == p.b.peer_id and stream.protocol == TEST_PROTOCOL
                for n in range(20):
                    await stream.send({"n": n})
                for n in range(20):
                    assert await stream.recv(timeout_s=5.0) == {"n": 2 * n}
                await stream.close()
            # the handler saw the end of stream, returned, and its side closed cleanly

    run(test)


def test_a_truncated_frame_is_reported_as_truncated() -> None:
    outcome: list[BaseException] = []
    done = trio.Event()

    async def reader(stream: FrameStream) -> None:
        try:
            await stream.recv(timeout_s=5.0)
        except StreamClosedError as exc:
            outcome.append(exc)
        finally:
            done.set()

    async def test() -> None:
        async with two_hosts() as p:
            p.b.set_handler(TEST_PROTOCOL, reader)
            raw = await p.a.libp2p.new_stream(
                ID.from_base58(p.b.peer_id), [TProtocol(TEST_PROTOCOL)]
            )
            frame = encode_frame({"payload": "x" * 1000})
            await raw.write(frame[:500])
            await raw.close()
            await done.wait()
            assert len(outcome) == 1 and isinstance(outcome[0], StreamClosedError)
            assert outcome[0].truncated and outcome[0].peer_id == p.a.peer_id

    run(test)


def test_an_oversized_frame_resets_the_stream_and_the_host_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def test() -> None:
        async with two_hosts() as p:
            raw = await raw_stream(p.a, p.b.peer_id, RPC_PROTOCOL)
            # declares 2 GB; the body never comes (and is never waited for)
            await raw.write((2**31).to_bytes(FRAME_HEADER_BYTES, "big") + b"\x81")
            # libp2p reports a reset that arrives before the read as an end of stream
            with pytest.raises((StreamReset, StreamEOF)):
                await raw.read(65536)  # nothing comes back, and the stream is over
            await raw.reset()
            assert await call_ping(p.a, p.b.peer_id) < 1.0
            assert p.a.peer_id in p.b.connected_peers()

    with caplog.at_level(logging.DEBUG, logger="swarmd.net.host"):
        run(test)
    refused = [r for r in caplog.records if "2147483648" in r.getMessage()]
    assert len(refused) == 1 and "over the" in refused[0].getMessage()


def test_a_plaintext_only_host_cannot_connect() -> None:
    async def test() -> None:
        key_pair = create_new_key_pair()
        plain = new_host(
            key_pair=key_pair,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        )
        plain_id = str(plain.get_id())
        async with (
            open_host(Identity.generate(), 0) as ours,
            plain.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]),
        ):
            RpcService(ours)
            # plaintext -> ours
            with pytest.raises(BaseLibp2pError):
                await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(ours.addrs[0])))
            assert plain_id not in ours.connected_peers()
            # ours -> plaintext
            plain_addr = f"{plain.get_transport_addrs()[0]}/p2p/{plain_id}"
            with pytest.raises(DialError):
                await ours.connect(plain_addr)
            assert plain_id not in ours.connected_peers()
            assert ours.peer_id not in [str(pid) for pid in plain.get_connected_peers()]

    run(test)


def test_bad_listen_addresses_are_refused() -> None:
    async def test() -> None:
        async with open_host(Identity.generate(), 0) as first:
            with pytest.raises(ConfigError, match="in use"):
                async with open_host(Identity.generate(), first.port):
                    pass
        for host_ip in ("localhost", "192.0.2.123"):  # a name; an address not on this machine
            with pytest.raises(ConfigError):
                async with open_host(Identity.generate(), 0, host_ip=host_ip):
                    pass

    run(test)


def test_errors_cross_the_host_block_unwrapped_and_cancellation_closes_it() -> None:
    async def test() -> None:
        with pytest.raises(DialError, match="from the block"):
            async with two_hosts():
                raise DialError("from the block")
        # Cancelled right after the ping (not by a timer that could fire during start-up).
        with trio.CancelScope() as scope:
            async with two_hosts() as p:
                await call_ping(p.a, p.b.peer_id)
                scope.cancel()
                await trio.sleep_forever()
        assert scope.cancelled_caught

    run(test)


def test_no_timeout_means_no_limit_of_its_own() -> None:
    async def test() -> None:
        async with two_hosts() as p:
            assert await call(p.a, p.b.peer_id, "ping", {}, math.inf) == {}

    run(test)


SILENT_PEER = f"""
import trio
from swarmd.net.host import open_host
from swarmd.net.identity import Identity

async def main():
    async with open_host(Identity.generate(), 0) as host:
        async def hold(stream):
            await trio.sleep_forever()
        host.set_handler("{TEST_PROTOCOL}", hold)
        print(host.addrs[0], flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def test_a_silent_peer_turns_into_an_error() -> None:
    """A peer that stops answering (SIGSTOP) ends a pending read within seconds."""
    proc = subprocess.Popen([sys.executable, "-c", SILENT_PEER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    config = HostConfig(health_check_interval_s=1.0, health_ping_timeout_s=1.0)

    async def test() -> None:
        addr = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        assert addr.startswith("/ip4/127.0.0.1/"), f"the peer did not start: {addr!r}"
        async with open_host(Identity.generate(), 0, config=config) as host:
            peer_id = await host.connect(addr.strip())
            async with await host.open_stream(peer_id, TEST_PROTOCOL) as stream:
                os.kill(proc.pid, signal.SIGSTOP)
                stopped = trio.current_time()
                with pytest.raises(StreamClosedError):
                    await stream.recv(timeout_s=math.inf)  # no timeout of our own
                assert trio.current_time() - stopped < 10.0

    try:
        run(test)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_inbound_streams_past_a_peers_cap_are_reset_and_the_cap_frees_with_them() -> None:
    cap = 3
    release = trio.Event()
    served_tx, served_rx = trio.open_memory_channel[int](math.inf)

    async def hold(stream: FrameStream) -> None:
        i = (await stream.recv(5.0))["i"]
        served_tx.send_nowait(i)
        if i < cap + 2:  # the first round holds its streams open
            await release.wait()

    async def test() -> None:
        config = HostConfig(max_inbound_streams_per_peer=cap, max_streams=64)
        async with (
            open_host(Identity.generate(), 0) as a,
            open_host(Identity.generate(), 0, config=config) as b,
        ):
            b.set_handler(TEST_PROTOCOL, hold)
            RpcService(b)  # its ping, below
            assert await a.connect(b.addrs[0]) == b.peer_id
            # libp2p's resource manager is the one made from the config
            manager = b.libp2p.get_network()._resource_manager
            assert manager is not None and manager.limits.max_streams == 64
            streams = []
            with trio.fail_after(5.0):
                for i in range(cap):
                    streams.append(await a.open_stream(b.peer_id, TEST_PROTOCOL))
                    await streams[-1].send({"i": i})
                    assert await served_rx.receive() == i
            for i in range(cap, cap + 2):  # reset as it opens, or at its first read
                with pytest.raises(PeerError):
                    extra = await a.open_stream(b.peer_id, TEST_PROTOCOL)
                    with contextlib.suppress(StreamClosedError):
                        await extra.send({"i": i})
                    await extra.recv(5.0)
            assert served_rx.statistics().current_buffer_used == 0  # none served
            # the count goes down as the streams end, and the connection is untouched
            assert b.inbound_streams(a.peer_id) == cap
            release.set()
            for stream in streams:
                await stream.close()
            with trio.fail_after(5.0):
                while b.inbound_streams(a.peer_id):  # noqa: ASYNC110 (a count, polled)
                    await trio.sleep(0.01)
                for i in range(10, 10 + cap):
                    again = await a.open_stream(b.peer_id, TEST_PROTOCOL)
                    await again.send({"i": i})
                    assert await served_rx.receive() == i
                    await again.close()
            assert await call_ping(a, b.peer_id, timeout_s=5.0) < 1.0

    run(test)
