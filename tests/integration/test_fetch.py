"""Model files between libp2p hosts on 127.0.0.1, in one trio run: `FileServer` (holder)
and `Fetcher` (the node that downloads), with liars, dying holders, resumes and limits.

The model is three small files of random bytes (no torch), cut into 64 KiB chunks with
a partial last one. Every test puts a deadline on its whole run, waits on events (never
a bare sleep) and closes every host it opened, even when it fails.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from swarmd.dht.records import NodeRecord
from swarmd.errors import FetchError, RemoteError
from swarmd.model.hashing import hash_file
from swarmd.model.layers import LayerRange
from swarmd.model.manifest import (
    MIN_CHUNK_BYTES,
    FileEntry,
    Manifest,
    ShardEntry,
    parse_manifest,
)
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.net.rpc import RpcService
from swarmd.transfer.fetch import Fetcher, FetchSettings
from swarmd.transfer.files import (
    FileServer,
    FileServeSettings,
    call_file_chunk,
    call_manifest,
)

RUN_DEADLINE_S = 20.0
STOP_DEADLINE_S = 10.0
CHUNK = MIN_CHUNK_BYTES
NUM_LAYERS = 4
TOKENIZER = "tokenizer.json"
SHARD_A = "layers-00000-00002.safetensors"
SHARD_B = "layers-00002-00004.safetensors"
# 2, 5 and 10 chunks, each with a partial last chunk
SIZES = {TOKENIZER: 100_000, SHARD_A: 300_000, SHARD_B: 600_000}
FETCH = FetchSettings(chunk_timeout_s=5.0, deadline_s=2.0)
SERVE = FileServeSettings()


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(RUN_DEADLINE_S):
            await test()

    trio.run(main)


# --- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    folder: Path  # every file, as the manifest says
    manifest: Manifest
    data: dict[str, bytes]

    @property
    def content_id(self) -> str:
        return self.manifest.content_id

    def entry(self, name: str) -> FileEntry:
        entry = self.manifest.entry(name)
        assert entry is not None
        return entry

    @property
    def every_file(self) -> list[FileEntry]:
        return self.manifest.files_for(LayerRange(0, NUM_LAYERS))


def _entry(folder: Path, name: str) -> FileEntry:
    whole, chunks = hash_file(folder / name, CHUNK)
    return FileEntry(name, (folder / name).stat().st_size, whole, chunks)


def _shard(folder: Path, name: str, start: int, end: int) -> ShardEntry:
    e = _entry(folder, name)
    return ShardEntry(e.file, e.bytes, e.sha256, e.chunks, start, end)


@pytest.fixture
def model(tmp_path: Path) -> Model:
    folder = tmp_path / "holder"
    folder.mkdir()
    data = {name: random.Random(name).randbytes(size) for name, size in SIZES.items()}
    for name, content in data.items():
        (folder / name).write_bytes(content)
    manifest = Manifest(
        model_id="tiny-fetch",
        architecture="llama",
        config={"model_type": "llama", "num_hidden_layers": NUM_LAYERS},
        num_layers=NUM_LAYERS,
        dtype="float32",
        weights="fp32",
        chunk_bytes=CHUNK,
        files=(_entry(folder, TOKENIZER),),
        shards=(_shard(folder, SHARD_A, 0, 2), _shard(folder, SHARD_B, 2, 4)),
    )
    assert [len(e.chunks) for e in manifest.files_for(LayerRange(0, 4))] == [2, 5, 10]
    return Model(folder, manifest, data)


# --- holders ----------------------------------------------------------------------------


class RecordingServer(FileServer):
    """A FileServer that records every chunk asked of it: (peer, file, index)."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        verified: list[FileEntry],
        settings: FileServeSettings = SERVE,
    ) -> None:
        super().__init__(folder, manifest, verified, settings)
        self.calls: list[tuple[str, str, int]] = []

    async def rpc_file_chunk(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((peer_id, args["file"], args["index"]))
        return await super().rpc_file_chunk(peer_id, args)

    def asked(self, name: str) -> list[int]:
        return [index for _, file, index in self.calls if file == name]


TAMPERS: dict[str, Callable[[bytes], bytes]] = {
    "flipped-byte": lambda data: data[:10] + bytes([data[10] ^ 0xFF]) + data[11:],
    "short": lambda data: data[:-1],
    "long": lambda data: data + b"\x00",
    "other-chunk": lambda data: data[::-1],
}


class LyingServer(RecordingServer):
    """Holds the right files, but changes chunk 1 of every file it sends."""

    tamper = staticmethod(TAMPERS["flipped-byte"])

    async def rpc_file_chunk(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        result = await super().rpc_file_chunk(peer_id, args)
        if args["index"] == 1:
            return {"data": self.tamper(result["data"])}
        return result


class DyingServer(RecordingServer):
    """Serves `serves` chunks; the next request never gets an answer (the test then
    closes this holder's host)."""

    def __init__(self, folder: Path, manifest: Manifest, serves: int) -> None:
        super().__init__(folder, manifest, manifest.files_for(LayerRange(0, NUM_LAYERS)))
        self.serves = serves
        self.dying = trio.Event()

    async def rpc_file_chunk(self, peer_id: str, args: dict[str, Any]) -> dict[str, Any]:
        if len(self.calls) >= self.serves:
            self.calls.append((peer_id, args["file"], args["index"]))
            self.dying.set()
            await trio.sleep_forever()
        return await super().rpc_file_chunk(peer_id, args)


@dataclass
class Holder:
    host: P2PHost
    server: FileServer
    scope: trio.CancelScope
    closed: trio.Event

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    async def stop(self) -> None:
        self.scope.cancel()
        with trio.fail_after(STOP_DEADLINE_S):
            await self.closed.wait()


async def _serve_holder(
    server: FileServer, task_status: trio.TaskStatus[Holder] = trio.TASK_STATUS_IGNORED
) -> None:
    closed = trio.Event()
    try:
        with trio.CancelScope() as scope:
            async with open_host(Identity.generate(), 0) as host:
                server.register(RpcService(host))
                task_status.started(Holder(host, server, scope, closed))
                await trio.sleep_forever()
    finally:
        closed.set()


@asynccontextmanager
async def holders(*servers: FileServer) -> AsyncIterator[list[Holder]]:
    """One host per server; all closed when the block exits."""
    async with trio.open_nursery() as nursery:
        nodes = [await nursery.start(_serve_holder, server) for server in servers]
        try:
            yield nodes
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_of(*nodes: Holder) -> AsyncIterator[P2PHost]:
    """A host connected to every holder given (the Fetcher dials by peer id)."""
    async with open_host(Identity.generate(), 0) as host:
        for node in nodes:
            assert await host.connect(node.host.addrs[0]) == node.peer_id
        yield host


def good_server(model: Model, settings: FileServeSettings = SERVE) -> RecordingServer:
    return RecordingServer(model.folder, model.manifest, model.every_file, settings)


# --- the fetching side ------------------------------------------------------------------


def record(peer_id: str, model: Model, layers: tuple[int, int], **changes: Any) -> NodeRecord:
    base = NodeRecord(
        peer_id=peer_id,
        model_id=model.manifest.model_id,
        model_hash=model.content_id,
        layer_start=layers[0],
        layer_end=layers[1],
        num_layers=NUM_LAYERS,
        dtype="float32",
        weights="fp32",
        free_kv_tokens=8192,
        kv_budget_tokens=8192,
        throughput_tps=10.0,
        state="ready",
        addrs=(),
        api_url="",
        version="0.1.0",
        expires_at=0.0,
    )
    return dataclasses.replace(base, **changes)


@dataclass
class Swarm:
    """What the Fetcher sees of the DHT: the records a lookup returns; the bans it made."""

    records: list[NodeRecord]
    lookups: int = 0
    bans: list[tuple[str, str]] = field(default_factory=list)

    async def lookup(self) -> list[NodeRecord]:
        self.lookups += 1
        await trio.lowlevel.checkpoint()
        return list(self.records)

    async def ban(self, peer_id: str, why: str) -> None:
        self.bans.append((peer_id, why))
        await trio.lowlevel.checkpoint()


@dataclass
class RecordingProgress:
    started: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> total, done
    advanced: dict[str, int] = field(default_factory=dict)  # name -> bytes
    finished: list[str] = field(default_factory=list)

    def start(self, name: str, total: int, done: int) -> None:
        assert name not in self.started
        self.started[name] = (total, done)

    def advance(self, name: str, size: int) -> None:
        assert name in self.started and name not in self.finished
        self.advanced[name] = self.advanced.get(name, 0) + size

    def finish(self, name: str) -> None:
        self.finished.append(name)


def fetcher(
    client: P2PHost,
    model: Model,
    folder: Path,
    swarm: Swarm,
    progress: RecordingProgress | None = None,
    settings: FetchSettings = FETCH,
) -> Fetcher:
    return Fetcher(client, model.manifest, folder, swarm.lookup, swarm.ban, settings, progress)


def assert_fetched(model: Model, folder: Path, names: list[str]) -> None:
    for name in names:
        assert (folder / name).read_bytes() == model.data[name], name
    assert list(folder.glob("*.part")) == []


# --- tests ------------------------------------------------------------------------------


def test_a_good_holder_serves_every_file(model: Model, tmp_path: Path) -> None:
    dest = tmp_path / "fetched"
    server = good_server(model)
    progress = RecordingProgress()

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm([record(holder.peer_id, model, (0, NUM_LAYERS))])
            fetch = fetcher(client, model, dest, swarm, progress)
            await fetch.fetch(model.every_file)
            assert fetch.bytes_fetched == sum(SIZES.values())
            # every file is there now: a second fetch asks nobody for anything
            asked = len(server.calls)
            await fetcher(client, model, dest, swarm).fetch(model.every_file)
            assert len(server.calls) == asked

    run(test)
    assert_fetched(model, dest, list(SIZES))
    assert sorted(p.name for p in dest.iterdir()) == sorted(SIZES)
    assert progress.started == {name: (size, 0) for name, size in SIZES.items()}
    assert progress.advanced == SIZES
    assert progress.finished == [TOKENIZER, SHARD_A, SHARD_B]
    for entry in model.every_file:  # each chunk asked once, in order
        assert server.asked(entry.file) == list(range(len(entry.chunks)))
    assert server.bytes_sent == sum(SIZES.values())


@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_a_lying_holder_is_banned_and_the_next_one_finishes(
    model: Model, tmp_path: Path, tamper: str
) -> None:
    dest = tmp_path / "fetched"
    liar = LyingServer(model.folder, model.manifest, model.every_file)
    liar.tamper = TAMPERS[tamper]
    good = good_server(model)
    bans: list[tuple[str, str]] = []
    liar_id: list[str] = []

    async def test() -> None:
        async with holders(liar, good) as [bad, fine], client_of(bad, fine) as client:
            liar_id.append(bad.peer_id)
            # Holders whose layers cover a shard are tried first (random within a group):
            # the liar's record covers shard A, the good holder's does not.
            swarm = Swarm([record(bad.peer_id, model, (0, 2)), record(fine.peer_id, model, (2, 4))])
            fetch = fetcher(client, model, dest, swarm)
            await fetch.fetch([model.entry(SHARD_A), model.entry(TOKENIZER)])
            bans.extend(swarm.bans)

    run(test)
    assert_fetched(model, dest, [SHARD_A, TOKENIZER])
    assert [peer for peer, _ in bans] == liar_id  # once, the liar
    why = bans[0][1]
    assert "chunk 1" in why and SHARD_A in why
    assert liar.asked(SHARD_A) == [0, 1]
    assert liar.asked(TOKENIZER) == []  # banned: never asked again
    assert good.asked(SHARD_A) == [1, 2, 3, 4]
    assert good.asked(TOKENIZER) == [0, 1]


PARTS: dict[str, tuple[Callable[[bytes], bytes], list[int]]] = {
    # what the .part holds -> the chunks still asked for
    "two-good-chunks-then-garbage": (lambda d: d[: 2 * CHUNK] + b"garbage" * 1000, [2, 3, 4]),
    "cut-inside-chunk-3": (lambda d: d[: 3 * CHUNK + 100], [3, 4]),
    "bad-first-chunk": (lambda d: b"\x00" + d[1 : 3 * CHUNK], [0, 1, 2, 3, 4]),
    "empty": (lambda d: b"", [0, 1, 2, 3, 4]),
    "every-chunk-then-garbage": (lambda d: d + b"xyz", [4]),
    "the-whole-file": (lambda d: d, []),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_a_part_file_resumes_after_its_last_good_chunk(
    model: Model, tmp_path: Path, part: str
) -> None:
    make_part, still_asked = PARTS[part]
    dest = tmp_path / "fetched"
    dest.mkdir()
    (dest / f".{SHARD_A}.part").write_bytes(make_part(model.data[SHARD_A]))
    server = good_server(model)
    progress = RecordingProgress()

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm([record(holder.peer_id, model, (0, NUM_LAYERS))])
            fetch = fetcher(client, model, dest, swarm, progress)
            await fetch.fetch([model.entry(SHARD_A)])
            assert fetch.bytes_fetched == sum(
                model.entry(SHARD_A).chunk_span(i, CHUNK)[1] for i in still_asked
            )

    run(test)
    assert_fetched(model, dest, [SHARD_A])
    assert server.asked(SHARD_A) == still_asked
    first = still_asked[0] if still_asked else 5
    assert progress.started[SHARD_A] == (SIZES[SHARD_A], min(SIZES[SHARD_A], first * CHUNK))
    assert progress.finished == [SHARD_A]


def test_a_holder_that_dies_mid_transfer_is_replaced(model: Model, tmp_path: Path) -> None:
    dest = tmp_path / "fetched"
    dying = DyingServer(model.folder, model.manifest, serves=2)
    good = good_server(model)

    async def test() -> None:
        async with holders(dying, good) as [first, second], client_of(first, second) as client:
            swarm = Swarm(
                [record(first.peer_id, model, (0, 2)), record(second.peer_id, model, (2, 4))]
            )
            fetch = fetcher(client, model, dest, swarm)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch.fetch, [model.entry(SHARD_A)])
                await dying.dying.wait()
                await first.stop()
            assert swarm.bans == []  # gone is not lying

    run(test)
    assert_fetched(model, dest, [SHARD_A])
    assert dying.asked(SHARD_A) == [0, 1, 2]
    assert good.asked(SHARD_A) == [2, 3, 4]


def test_the_transfer_cap_turns_a_second_peer_away(model: Model) -> None:
    server = good_server(model, FileServeSettings(max_transfers=1))
    a, b = model.entry(SHARD_A), model.entry(SHARD_B)

    async def test() -> None:
        async with (
            holders(server) as [holder],
            client_of(holder) as first,
            client_of(holder) as second,
        ):
            cid, peer = model.content_id, holder.peer_id
            assert await call_file_chunk(first, peer, cid, a.file, 0) == model.data[a.file][:CHUNK]
            assert server.active_transfers == 1
            with pytest.raises(RemoteError) as caught:
                await call_file_chunk(second, peer, cid, b.file, 0)
            assert caught.value.remote_type == "OverloadedError"
            assert caught.value.method == "file_chunk" and caught.value.peer_id == peer
            # a transfer is one peer and one file: the same peer on another file waits too
            with pytest.raises(RemoteError, match="OverloadedError"):
                await call_file_chunk(first, peer, cid, b.file, 0)
            for index in range(1, len(a.chunks)):
                await call_file_chunk(first, peer, cid, a.file, index)
            assert server.active_transfers == 0
            data = await call_file_chunk(second, peer, cid, b.file, 0)
            assert data == model.data[b.file][:CHUNK]
            assert server.active_transfers == 1

    run(test)


def test_one_peer_gets_at_most_its_share_of_the_transfers(model: Model) -> None:
    server = good_server(model, FileServeSettings(max_transfers=3, max_peer_transfers=2))
    a, b, tok = model.entry(SHARD_A), model.entry(SHARD_B), model.entry(TOKENIZER)

    async def test() -> None:
        async with (
            holders(server) as [holder],
            client_of(holder) as greedy,
            client_of(holder) as other,
        ):
            cid, peer = model.content_id, holder.peer_id
            await call_file_chunk(greedy, peer, cid, a.file, 0)
            await call_file_chunk(greedy, peer, cid, b.file, 0)
            assert server.active_transfers == 2
            # a third file for the same peer: busy, though the node has a slot left
            with pytest.raises(RemoteError) as caught:
                await call_file_chunk(greedy, peer, cid, tok.file, 0)
            assert caught.value.remote_type == "OverloadedError"
            assert "per peer" in str(caught.value)
            # ... which another peer gets
            data = await call_file_chunk(other, peer, cid, tok.file, 0)
            assert data == model.data[tok.file][:CHUNK]
            assert server.active_transfers == 3
            # the greedy peer's own transfers go on
            assert (
                await call_file_chunk(greedy, peer, cid, a.file, 1)
                == (model.data[a.file][CHUNK : 2 * CHUNK])
            )

    run(test)


def test_one_peer_gets_at_most_its_share_of_chunks_in_flight(model: Model) -> None:
    rate = CHUNK / 0.5  # bytes/s: each chunk is held back half a second
    server = good_server(model, FileServeSettings(max_peer_transfers=2, upload_bytes_per_s=rate))
    a = model.entry(SHARD_A)

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            cid, peer = model.content_id, holder.peer_id
            got: dict[int, bytes] = {}

            async def fetch(index: int) -> None:
                got[index] = await call_file_chunk(client, peer, cid, a.file, index)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, 0)
                nursery.start_soon(fetch, 1)
                with trio.fail_after(5.0):
                    while len(server.calls) < 2:  # noqa: ASYNC110 (a list, polled)
                        await trio.sleep(0.01)
                with pytest.raises(RemoteError) as caught:
                    await call_file_chunk(client, peer, cid, a.file, 2)
                assert caught.value.remote_type == "OverloadedError"
            assert sorted(got) == [0, 1] and got[1] == model.data[a.file][CHUNK : 2 * CHUNK]
            # both answered: the peer may ask again
            assert (
                await call_file_chunk(client, peer, cid, a.file, 2)
                == (model.data[a.file][2 * CHUNK : 3 * CHUNK])
            )

    run(test)


def test_only_files_that_match_the_manifest_are_served(model: Model, tmp_path: Path) -> None:
    folder = tmp_path / "seed"
    shutil.copytree(model.folder, folder)
    corrupt = bytearray(model.data[SHARD_B])
    corrupt[5 * CHUNK + 3] ^= 0x01  # chunk 0 itself is still right
    (folder / SHARD_B).write_bytes(bytes(corrupt))
    (folder / TOKENIZER).unlink()
    (folder / "secret.txt").write_bytes(b"not in the manifest")
    server = RecordingServer(folder, model.manifest, verified=[])  # nothing checked yet

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            cid, peer = model.content_id, holder.peer_id
            for name in (SHARD_B, SHARD_B, TOKENIZER, "secret.txt", "../holder/" + SHARD_A):
                with pytest.raises(RemoteError) as caught:
                    await call_file_chunk(client, peer, cid, name, 0)
                assert caught.value.remote_type == "ModelNotFoundError", name
            # present and right, though not verified at start-up: hashed, then served
            data = [
                await call_file_chunk(client, peer, cid, SHARD_A, i)
                for i in range(len(model.entry(SHARD_A).chunks))
            ]
            assert b"".join(data) == model.data[SHARD_A]
            # a Fetcher set aside by every holder gives up with FetchError, bans no one
            swarm = Swarm([record(peer, model, (0, NUM_LAYERS))])
            settings = FetchSettings(chunk_timeout_s=5.0, deadline_s=0.1)
            with pytest.raises(FetchError, match=SHARD_B):
                await fetcher(client, model, tmp_path / "out", swarm, settings=settings).fetch(
                    [model.entry(SHARD_B)]
                )
            assert swarm.bans == []

    run(test)
    assert server.bytes_sent == SIZES[SHARD_A]


def test_unusable_records_are_never_asked(model: Model, tmp_path: Path) -> None:
    server = good_server(model)
    other = dataclasses.replace(model.manifest, dtype="float16").content_id

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm(
                [
                    record(holder.peer_id, model, (0, 4), model_hash=other),
                    record(holder.peer_id, model, (0, 4), model_hash=""),
                    record(client.peer_id, model, (0, 4)),  # itself
                ]
            )
            settings = FetchSettings(chunk_timeout_s=5.0, deadline_s=0.1)
            with pytest.raises(FetchError, match=TOKENIZER):
                await fetcher(client, model, tmp_path / "out", swarm, settings=settings).fetch(
                    [model.entry(TOKENIZER)]
                )
            assert swarm.lookups >= 2  # looked again after a pause before giving up

    run(test)
    assert server.calls == []


def test_the_upload_limit_paces_a_transfer(model: Model, tmp_path: Path) -> None:
    rate = 1e6  # bytes/s
    server = good_server(model, FileServeSettings(upload_bytes_per_s=rate))
    dest = tmp_path / "fetched"

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm([record(holder.peer_id, model, (0, NUM_LAYERS))])
            started = trio.current_time()
            await fetcher(client, model, dest, swarm).fetch([model.entry(SHARD_B)])
            elapsed = trio.current_time() - started
            # every chunk waits until the limit lets its bytes out: a lower bound only
            assert elapsed >= 0.95 * SIZES[SHARD_B] / rate

    run(test)
    assert_fetched(model, dest, [SHARD_B])
    assert server.bytes_sent == SIZES[SHARD_B]


def test_call_manifest_answers_only_for_its_content_id(model: Model) -> None:
    server = good_server(model)

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            other = dataclasses.replace(model.manifest, model_id="other").content_id
            with pytest.raises(RemoteError) as caught:
                await call_manifest(client, holder.peer_id, other)
            assert caught.value.remote_type == "ModelNotFoundError"
            assert caught.value.method == "manifest"
            raw = await call_manifest(client, holder.peer_id, model.content_id)
            assert parse_manifest(raw, expected_id=model.content_id) == model.manifest
            assert raw == model.manifest.to_json()

    run(test)


def test_a_silent_holder_times_out_and_the_next_one_finishes(model: Model, tmp_path: Path) -> None:
    dest = tmp_path / "fetched"
    silent = DyingServer(model.folder, model.manifest, serves=0)  # never answers a chunk
    good = good_server(model)
    settings = FetchSettings(chunk_timeout_s=1.0, deadline_s=2.0)

    async def test() -> None:
        async with holders(silent, good) as [first, second], client_of(first, second) as client:
            swarm = Swarm(
                [record(first.peer_id, model, (0, 2)), record(second.peer_id, model, (2, 4))]
            )
            await fetcher(client, model, dest, swarm, settings=settings).fetch(
                [model.entry(SHARD_A)]
            )
            assert swarm.bans == []  # slow is not lying

    run(test)
    assert_fetched(model, dest, [SHARD_A])
    assert silent.asked(SHARD_A) == [0]
    assert good.asked(SHARD_A) == [0, 1, 2, 3, 4]


def test_a_manifest_whose_chunks_contradict_its_file_hash_fails_the_file(
    model: Model, tmp_path: Path
) -> None:
    """Every chunk matches, the whole file does not: the .part is dropped, nobody banned."""
    dest = tmp_path / "fetched"
    tokenizer = dataclasses.replace(model.entry(TOKENIZER), sha256="ab" * 32)
    manifest = dataclasses.replace(model.manifest, files=(tokenizer,))
    server = RecordingServer(model.folder, manifest, [tokenizer])  # trusts it as verified

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm([record(holder.peer_id, model, (0, 4), model_hash=manifest.content_id)])
            fetch = Fetcher(client, manifest, dest, swarm.lookup, swarm.ban, FETCH)
            with pytest.raises(FetchError, match="hashes to"):
                await fetch.fetch([tokenizer])
            assert swarm.bans == []

    run(test)
    assert server.asked(TOKENIZER) == [0, 1]
    assert list(dest.iterdir()) == []


def test_a_file_named_like_another_files_part_survives_the_fetch(
    model: Model, tmp_path: Path
) -> None:
    """`parse_manifest` accepts both `tokenizer.json` and `tokenizer.json.part` as names;
    the Fetcher's scratch file for the first must not be the second, fetched before it."""
    twin = f"{TOKENIZER}.part"
    twin_data = random.Random(twin).randbytes(90_000)
    (model.folder / twin).write_bytes(twin_data)
    manifest = dataclasses.replace(
        model.manifest, files=(_entry(model.folder, twin), model.entry(TOKENIZER))
    )
    assert parse_manifest(manifest.to_json()) == manifest  # a valid manifest
    server = RecordingServer(model.folder, manifest, list(manifest.files))
    dest = tmp_path / "fetched"

    async def test() -> None:
        async with holders(server) as [holder], client_of(holder) as client:
            swarm = Swarm([record(holder.peer_id, model, (0, 4), model_hash=manifest.content_id)])
            fetch = Fetcher(client, manifest, dest, swarm.lookup, swarm.ban, FETCH)
            await fetch.fetch(list(manifest.files))  # "each is verified when this returns"

    run(test)
    assert server.asked(twin) == [0, 1]
    assert (dest / TOKENIZER).read_bytes() == model.data[TOKENIZER]
    assert (dest / twin).is_file(), f"{twin} was fetched, then taken as {TOKENIZER}'s scratch"
    assert (dest / twin).read_bytes() == twin_data
