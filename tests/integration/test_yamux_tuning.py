"""yamux as swarmd tunes it (`net/yamux_tuning.py`), between real hosts on 127.0.0.1:
small frames back and forth send almost no window updates (credit goes back by halves of
the window, not after every read), and frames many windows long still arrive whole, in
both directions at once and to a reader that takes its time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.stream_muxer.yamux import yamux

from swarmd.net import yamux_tuning
from swarmd.net.frames import FrameStream
from swarmd.net.host import open_host
from swarmd.net.identity import Identity
from tests.trio_run import run_trio

DEADLINE_S = 60.0
PROTOCOL = "/swarmd-test/echo/1"
WINDOW = yamux.DEFAULT_WINDOW_SIZE
TYPE_WINDOW_UPDATE = 1  # the second byte of a yamux header


def run(test: Callable[[], Awaitable[None]]) -> None:
    run_trio(test, DEADLINE_S)


@asynccontextmanager
async def echo_stream(delay_s: float = 0.0) -> AsyncIterator[FrameStream]:
    """A stream to a second host that echoes every frame (after `delay_s`)."""
    async with open_host(Identity.generate(), 0) as a, open_host(Identity.generate(), 0) as b:

        async def echo(stream: FrameStream) -> None:
            while True:
                frame = await stream.recv(DEADLINE_S)
                await trio.sleep(delay_s)
                await stream.send(frame)

        b.set_handler(PROTOCOL, echo, gated=False)
        await a.connect(b.addrs[0])
        stream = await a.open_stream(b.peer_id, PROTOCOL)
        yield stream
        await stream.close()


@pytest.fixture
def frame_types(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """yamux frames written by every host from now on, by type."""
    counts: dict[int, int] = {}

    yamux_tuning.apply()  # what open_host does first: the tuned writer is the one wrapped
    write_frame = yamux.Yamux._write_frame

    async def counted(self: yamux.Yamux, data: bytes) -> None:
        counts[data[1]] = counts.get(data[1], 0) + 1
        await write_frame(self, data)

    monkeypatch.setattr(yamux.Yamux, "_write_frame", counted)
    return counts


def test_small_frames_back_and_forth_send_almost_no_window_updates(
    frame_types: dict[int, int],
) -> None:
    async def test() -> None:
        async with echo_stream() as stream:
            payload = {"t": "step", "x": b"\0" * 2048}
            for _ in range(300):
                await stream.send(payload)
                assert await stream.recv(DEADLINE_S) == payload
            # 600 data frames of ~2 KB: 1.2 MB each way is a few windows' worth of credit.
            updates = frame_types.get(TYPE_WINDOW_UPDATE, 0)
            assert frame_types.get(0, 0) >= 600
            assert updates <= 2 * (2 * 300 * 2100 // (WINDOW // 2) + 2), frame_types

    run(test)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_frames_many_windows_long_arrive_whole_both_ways(delay_s: float) -> None:
    async def test() -> None:
        async with echo_stream(delay_s) as stream:
            for size in (3 * WINDOW + 17, 9 * WINDOW):
                body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                await stream.send({"t": "blob", "x": body})
                echoed = await stream.recv(DEADLINE_S)
                assert echoed["x"] == body

    run(test)
