"""The fault-injecting proxy the network tests run through: each fault does what it says."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (a thread per connection)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    server.close()


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(echo_port) as running:
        yield running


def connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def echo(sock: socket.socket, payload: bytes) -> float:
    """Seconds for `payload` to come back whole."""
    started = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "the connection ended"
        got += chunk
    assert got == payload
    return time.monotonic() - started


def test_bytes_pass_unchanged_and_in_order(proxy: FaultProxy) -> None:
    proxy.shape(delay_ms=5, jitter_ms=4)  # jitter never reorders bytes
    with connect(proxy) as sock:
        for size in (1, 1000, 200_000):
            echo(sock, os.urandom(size))


def test_delay_applies_to_each_direction(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        echo(sock, b"warm")
        proxy.shape(delay_ms=40)
        # Out and back through the proxy: 40 ms each way, at the least.
        assert echo(sock, b"x") >= 0.08
        proxy.shape(delay_ms=40, direction="down")
        proxy.shape(delay_ms=0, direction="up")
        assert echo(sock, b"y") >= 0.04


def test_a_rate_cap_slows_a_transfer_to_it(proxy: FaultProxy) -> None:
    proxy.shape(rate_mbit=10)
    with connect(proxy) as sock:
        # 500 KB each way at 10 Mbit/s: at least 0.4 s to go through the capped link.
        assert echo(sock, os.urandom(500_000)) >= 0.4


def test_a_black_hole_holds_every_byte_until_healed(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        echo(sock, b"before")
        proxy.black_hole()
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(10)
        with connect(proxy) as late:  # a new connection is taken, and joins nothing
            late.settimeout(0.3)
            late.sendall(b"late")
            with pytest.raises(TimeoutError):
                late.recv(10)
            proxy.heal()
            late.settimeout(10)
            assert late.recv(10) == b"late"
        sock.settimeout(10)
        assert sock.recv(10) == b"held"


def test_a_black_hole_by_pid_stops_only_that_process_connections(proxy: FaultProxy) -> None:
    with connect(proxy) as mine:
        echo(mine, b"hello")
        assert proxy.connections() == [os.getpid()]
        proxy.black_hole(pid=os.getpid() + 1_000_000)  # nobody's
        echo(mine, b"still")
        proxy.black_hole(pid=os.getpid())
        mine.sendall(b"x")
        mine.settimeout(0.3)
        with pytest.raises(TimeoutError):
            mine.recv(1)
        proxy.heal()


def test_reset_tears_connections_and_new_ones_work(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        echo(sock, b"up")
        assert proxy.reset() == 1
        sock.settimeout(5)
        with pytest.raises((ConnectionResetError, AssertionError, BrokenPipeError)):
            echo(sock, b"gone")
    with connect(proxy) as again:
        echo(again, b"back")
