"""Slow clients against a node: request latency idle and under N slowloris sockets.

    python bench/slowloris.py [--sockets 300] [--head-timeout 10] [--requests 9]

Starts a node in this process on the embedded model (whole model, no peers), measures
the median latency of a 2-token chat request, opens N sockets that each trickle a
request head a byte every 250 ms, measures again, then reports how long the node took
to cut every slow socket (its head deadline) and ends with

    RESULT idle_ms=<p50> loaded_ms=<p50> cut_s=<s> cut=<n>/<N>
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from swarmd.config import Config
from swarmd.node import Node

BODY = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 2,
    "temperature": 0,
}


async def median_ms(http: aiohttp.ClientSession, url: str, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        async with http.post(url, json=BODY) as response:
            assert response.status == 200, await response.text()
            await response.read()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def trickle(writer: asyncio.StreamWriter, until: float) -> None:
    while not writer.is_closing() and time.monotonic() < until:
        try:
            writer.write(b"a")
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(0.25)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(
            port=0,
            data_dir=Path(tmp),
            http_head_timeout_s=args.head_timeout,
            max_connections_per_client=args.sockets + 64,  # they stand for many clients
        )
        node = await asyncio.to_thread(Node.prepare, config)
        await node.start()
        try:
            port = int(node.api_url.rsplit(":", 1)[1])
            url = node.api_url + "/v1/chat/completions"
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as http:
                await median_ms(http, url, 2)  # warm-up
                idle = await median_ms(http, url, args.requests)
                opened = time.monotonic()
                slow = [
                    await asyncio.open_connection("127.0.0.1", port) for _ in range(args.sockets)
                ]
                for _reader, writer in slow:
                    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                until = opened + args.head_timeout + 20
                tasks = [asyncio.create_task(trickle(w, until)) for _r, w in slow]
                loaded = await median_ms(http, url, args.requests)
                while time.monotonic() < until:  # the node cuts them: poll its count
                    if node.edge.stats.open == 0:
                        break
                    await asyncio.sleep(0.05)
                cut_s = time.monotonic() - opened
                for task in tasks:
                    task.cancel()
                for _reader, writer in slow:
                    writer.close()
            cut = node.edge.stats.head_timeouts
        finally:
            await node.stop()
    print(f"{args.sockets} slow sockets, head deadline {args.head_timeout:g} s")
    print(f"chat request p50: idle {idle:.1f} ms, with the slow sockets open {loaded:.1f} ms")
    print(f"all slow sockets cut {cut_s:.2f} s after they opened ({cut} head timeouts)")
    print(
        f"RESULT idle_ms={idle:.1f} loaded_ms={loaded:.1f} cut_s={cut_s:.2f} "
        f"cut={cut}/{args.sockets}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=300)
    parser.add_argument("--head-timeout", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=9)
    asyncio.run(main(parser.parse_args()))
