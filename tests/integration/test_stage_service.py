"""The stage protocol over real libp2p hosts on 127.0.0.1, in one trio run.

Each stage is a `StageService` on its own host, with a `StageRuntime` over part of the
tiny 4-layer random Llama, run by a torch worker thread awaited from trio as a node
does. A `Ring` coordinated by host X runs X's own layers through a `LoopLink` and the
others' over streams, and gets its tokens back on the last stage's `ret` stream.

Every test puts a deadline on its whole run, polls with deadlines (never a bare sleep),
and closes every host it opened, even when it fails.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import AutoConfig

from swarmd.errors import InternalError, PeerError, StageFailedError
from swarmd.model.layers import LayerRange
from swarmd.model.runtime import StageRuntime
from swarmd.model.sampling import SamplingParams
from swarmd.model.stage import StageModule, load_stage
from swarmd.model.worker import TorchWorker
from swarmd.model.worker_trio import run_job
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost, open_host
from swarmd.net.identity import Identity
from swarmd.pipeline import wire
from swarmd.pipeline.admission import KVBudget, PeerBudget, PeerLimits
from swarmd.pipeline.ring import Ring, RingTimeouts
from swarmd.pipeline.stage_service import HeldStage, StageService, StageTimeouts

RUN_DEADLINE_S = 30.0
FREED_WITHIN_S = 2.0
MODEL_ID = "tiny-stage-test"
NUM_LAYERS = 4
CONTEXT = 512
MAX_LENGTH = 128
STAGE_TIMEOUTS = StageTimeouts(open_s=5.0, idle_s=30.0, step_s=10.0)
RING_TIMEOUTS = RingTimeouts(open_s=5.0, step_s=5.0)
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 504, 3070, 314, 260, 2784, 30, 2, 17, 9000, 48000, 11]

# What the DHT's signed records would say: the addresses of every host these tests open
# (a stage dials a next hop only on addresses its record lists).
SIGNED: dict[str, frozenset[str]] = {}


async def signed_addrs(peer_id: str, fresh: bool) -> frozenset[str] | None:
    return SIGNED.get(peer_id)


@dataclass(frozen=True)
class Model:
    stages: dict[tuple[int, int], StageModule]
    vocab_size: int
    hidden_size: int


@pytest.fixture(scope="module")
def model(tiny_chat_dir: Path) -> Model:
    config = AutoConfig.from_pretrained(tiny_chat_dir)
    assert config.num_hidden_layers == NUM_LAYERS
    stages = {
        (a, b): load_stage(tiny_chat_dir, config, LayerRange(a, b), torch.float32)
        for a, b in ((0, 2), (2, 4), (0, 4))
    }
    return Model(stages, int(config.vocab_size), int(config.hidden_size))


# --- harness ----------------------------------------------------------------------------


@dataclass
class StageNode:
    """One host serving the stage protocol over `held`; `stop()` closes its host."""

    host: P2PHost
    service: StageService
    runtime: StageRuntime
    scope: trio.CancelScope
    closed: trio.Event
    budget: KVBudget
    peers: PeerBudget
    bans: list[tuple[str, str]] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    @property
    def addrs(self) -> tuple[str, ...]:
        return tuple(self.host.addrs)

    async def stop(self) -> None:
        self.scope.cancel()
        with trio.fail_after(10.0):
            await self.closed.wait()


def _running(service: StageService) -> bool:
    try:
        service.spawn(trio.lowlevel.checkpoint)
    except InternalError:
        return False
    return True


async def _serve_stage(
    model: Model,
    held: tuple[int, int],
    timeouts: StageTimeouts,
    budget_tokens: int,
    peer_limits: PeerLimits,
    task_status: trio.TaskStatus[StageNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    closed = trio.Event()
    budget = KVBudget(budget_tokens)
    peers = PeerBudget(budget, peer_limits)
    runtime = StageRuntime(model.stages[held], max_sessions=4)
    try:
        with trio.CancelScope() as scope:
            async with open_host(Identity.generate(), 0) as host, _worker(runtime) as worker:
                limits = wire.StageLimits(
                    peer_id=host.peer_id,
                    model_id=MODEL_ID,
                    held=LayerRange(*held),
                    num_layers=NUM_LAYERS,
                    hidden_size=model.hidden_size,
                    vocab_size=model.vocab_size,
                    context_length=CONTEXT,
                )
                bans: list[tuple[str, str]] = []

                async def ban(peer_id: str, why: str) -> None:
                    bans.append((peer_id, why))

                run = functools.partial(run_job, worker)
                SIGNED[host.peer_id] = frozenset(host.addrs)
                stage = HeldStage.of(limits, torch.float32, run, budget, peers)
                service = StageService(host, [stage], ban, timeouts, signed_addrs)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(service.run)
                    assert await poll(lambda: _running(service), 5.0)
                    task_status.started(
                        StageNode(host, service, runtime, scope, closed, budget, peers, bans)
                    )
                    await trio.sleep_forever()
    finally:
        closed.set()


@asynccontextmanager
async def _worker(runtime: StageRuntime) -> AsyncIterator[TorchWorker]:
    """The node's torch worker thread over this stage's runtime, stopped on exit."""
    worker = TorchWorker(runtime, threads=1)
    worker.start()
    try:
        yield worker
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(worker.shutdown)


@asynccontextmanager
async def stage_nodes(
    model: Model,
    *specs: tuple[tuple[int, int], StageTimeouts]
    | tuple[tuple[int, int], StageTimeouts, int]
    | tuple[tuple[int, int], StageTimeouts, int, PeerLimits],
) -> AsyncIterator[list[StageNode]]:
    """One `StageNode` per (held layers, timeouts[, KV budget tokens[, limits of other
    peers' sessions]]); all closed when the block exits."""
    async with trio.open_nursery() as nursery:
        nodes = []
        for held, t, *extra in specs:
            tokens = extra[0] if extra else 4 * MAX_LENGTH
            limits = extra[1] if len(extra) > 1 else PeerLimits()
            nodes.append(await nursery.start(_serve_stage, model, held, t, tokens, limits))
        try:
            yield nodes
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_peer() -> AsyncIterator[tuple[P2PHost, list[dict[str, Any]]]]:
    """A host that speaks the stage protocol by hand; what stages send it is collected."""
    received: list[dict[str, Any]] = []

    async def collect(stream: FrameStream) -> None:
        while True:
            try:
                received.append(await stream.recv(math.inf))
            except PeerError:
                return

    async with open_host(Identity.generate(), 0) as host:
        SIGNED[host.peer_id] = frozenset(host.addrs)
        host.set_handler(wire.STAGE_PROTOCOL, collect)
        yield host, received


async def poll(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate()` until it is true or the deadline passes."""
    deadline = trio.current_time() + timeout_s
    while trio.current_time() < deadline:
        if predicate():
            return True
        await trio.sleep(0.01)
    return predicate()


def open_request(
    coordinator: str,
    route: list[tuple[str, int, int]],
    addrs: dict[str, tuple[str, ...]],
    sid: str = "s1",
    hop: int = 0,
) -> wire.OpenRequest:
    return wire.OpenRequest(
        sid=sid,
        hop=hop,
        route=tuple(wire.RouteHop(p, a, b) for p, a, b in route),
        addrs=addrs,
        coordinator=coordinator,
        model_id=MODEL_ID,
        max_length=MAX_LENGTH,
        sampling=GREEDY,
        history=(),
    )


def ring_over(
    x: StageNode,
    y: StageNode,
    split: int = 2,
    coordinator: StageNode | None = None,
    sid: str = "s1",
) -> Ring:
    """X runs layers 0:split and Y split:4; the coordinator (default: X) gets the tokens."""
    c = coordinator or x
    request = open_request(
        c.peer_id,
        [(x.peer_id, 0, split), (y.peer_id, split, NUM_LAYERS)],
        {y.peer_id: y.addrs, x.peer_id: x.addrs, c.peer_id: c.addrs},
        sid,
    )
    return Ring(c.service, request, RING_TIMEOUTS, c.runtime.stage.vocab_size)


@asynccontextmanager
async def closing(ring: Ring) -> AsyncIterator[Ring]:
    try:
        yield ring
    finally:
        await ring.close()


async def first_token(ring: Ring) -> int:
    """Open `ring` and feed it the whole prompt; the token it draws."""
    await ring.open()
    reply = await ring.step(PROMPT, want=True)
    assert reply.token is not None
    return reply.token


def freed(*nodes: StageNode) -> bool:
    """No session open on any of `nodes`."""
    return all(node.runtime.session_count == 0 for node in nodes)


def reference_tokens(model: Model, chunks: list[list[int]], decode_steps: int) -> list[int]:
    """Greedy tokens of the whole model (0:4) in one runtime, fed the same chunks."""
    runtime = StageRuntime(model.stages[(0, 4)], max_sessions=1)
    runtime.open("ref", MAX_LENGTH, GREEDY)
    try:
        for chunk in chunks[:-1]:
            assert runtime.step("ref", torch.tensor([chunk]), False).token is None
        token = runtime.step("ref", torch.tensor([chunks[-1]]), True).token
        assert token is not None
        tokens = [token]
        for _ in range(decode_steps):
            token = runtime.step("ref", torch.tensor([[tokens[-1]]]), True).token
            assert token is not None
            tokens.append(token)
        return tokens
    finally:
        runtime.close("ref")


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def run(test: Callable[[], Awaitable[None]]) -> None:
    """trio.run with a deadline; a lone failure inside nurseries is raised as itself."""

    async def main() -> None:
        with trio.fail_after(RUN_DEADLINE_S):
            await test()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


# --- tests ------------------------------------------------------------------------------


def test_a_two_host_ring_matches_the_whole_model_and_frees_its_sessions(model: Model) -> None:
    chunks = [PROMPT[:7], PROMPT[7:]]
    decode_steps = 6
    expected = reference_tokens(model, chunks, decode_steps)

    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y):
            async with closing(ring_over(x, y)) as ring:
                await ring.open()
                assert x.runtime.session_count == 1 and y.runtime.session_count == 1
                assert x.peer_id in y.host.connected_peers()

                first = await ring.step(chunks[0], want=False)
                assert first.n == 0 and first.token is None
                reply = await ring.step(chunks[1], want=True)
                assert reply.n == 1 and reply.token is not None
                assert len(reply.stage_ms) == 2 and all(ms >= 0 for ms in reply.stage_ms)
                # the hidden state X sent Y: [T, H] float32
                assert reply.activation_bytes == len(chunks[1]) * model.hidden_size * 4
                tokens = [reply.token]
                for _ in range(decode_steps):
                    reply = await ring.step([tokens[-1]], want=True)
                    assert reply.token is not None
                    assert reply.activation_bytes == model.hidden_size * 4
                    tokens.append(reply.token)
                assert tokens == expected

            assert await poll(functools.partial(freed, x, y), FREED_WITHIN_S)
            assert x.bans == [] and y.bans == []

    run(test)


def _forgotten(node: StageNode, sid: str) -> bool:
    """The node no longer waits for (or holds) the return stream of ring `sid`."""
    return sid not in node.service._pending


def test_a_ring_closed_with_a_step_in_flight_lets_it_finish_without_a_failure(
    model: Model, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that leaves while a step is out (a client gone mid-step) closes the ring
    at once; the stages run that step, then the `end` behind it, and the last stage's
    token finds its return stream closed on the coordinator's side only: nobody reports
    a failure, every session is freed, no peer is banned. Another session on the same
    stages steps on meanwhile and draws what the whole model draws."""
    decode_steps = 4
    expected = reference_tokens(model, [PROMPT], decode_steps)

    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y):
            async with (
                closing(ring_over(x, y)) as ring,
                closing(ring_over(x, y, sid="s2")) as other,
            ):
                token = await first_token(ring)
                tokens = [await first_token(other)]
                ran = x.runtime.batches
                with trio.CancelScope() as caller:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(ring.step, [token], True)
                        # Out once stage 0 has run it: looked for at every scheduler
                        # pass (the worker thread counts it; no event to wait on), so
                        # the caller leaves while Y still has it to run.
                        with trio.fail_after(5.0):
                            while x.runtime.batches == ran:
                                await trio.lowlevel.checkpoint()
                        caller.cancel()
                assert caller.cancelled_caught  # it left before the answer came
                await ring.close()
                for _ in range(decode_steps):
                    reply = await other.step([tokens[-1]], want=True)
                    assert reply.token is not None
                    tokens.append(reply.token)
                assert tokens == expected

            assert await poll(functools.partial(freed, x, y), FREED_WITHIN_S)
            for sid in ("s1", "s2"):
                assert await poll(functools.partial(_forgotten, x, sid), FREED_WITHIN_S)
            assert x.bans == [] and y.bans == []
        failures = [r.getMessage() for r in caplog.records if "session failed" in r.getMessage()]
        assert failures == []

    run(test)


def test_an_idle_session_is_freed_on_the_stage_after_its_idle_timeout(model: Model) -> None:
    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), StageTimeouts(open_s=5.0, idle_s=0.3))]
        async with stage_nodes(model, *specs) as (x, y):
            async with closing(ring_over(x, y)) as ring:
                await ring.open()
                assert y.runtime.session_count == 1
                assert await poll(lambda: y.runtime.session_count == 0, FREED_WITHIN_S)
            assert await poll(lambda: x.runtime.session_count == 0, FREED_WITHIN_S)
            assert x.bans == [] and y.bans == []

    run(test)


def test_an_open_for_layers_a_stage_does_not_hold_is_refused_without_a_ban(
    model: Model,
) -> None:
    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y):
            ring = ring_over(x, y, split=1)  # asks Y for 1:4; it holds 2:4
            async with closing(ring):
                with pytest.raises(StageFailedError) as info:
                    await ring.open()
            assert info.value.kind == "declined"
            assert info.value.peer_id == y.peer_id
            assert "2:4" in str(info.value) and "1:4" in str(info.value)

            assert await poll(functools.partial(freed, x, y), FREED_WITHIN_S)
            assert y.bans == [] and x.bans == []

    run(test)


def test_a_stage_without_kv_room_refuses_the_open_without_a_ban_and_keeps_its_budget(
    model: Model,
) -> None:
    async def test() -> None:
        tight = ((2, 4), STAGE_TIMEOUTS, MAX_LENGTH - 1)
        specs = [((0, 2), STAGE_TIMEOUTS), tight, ((2, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y, z):
            ring = ring_over(x, y)
            async with closing(ring):
                with pytest.raises(StageFailedError) as info:
                    await ring.open()
            assert info.value.kind == "declined" and info.value.peer_id == y.peer_id
            assert f"{MAX_LENGTH:,} tokens" in str(info.value)
            assert await poll(lambda: x.budget.reserved == 0 and x.runtime.session_count == 0, 2)
            assert y.budget.reserved == 0 and y.bans == [] and x.bans == []
            # A stage with room: each stage reserves the session's tokens while it runs.
            ring = ring_over(x, z)
            async with closing(ring):
                await ring.open()
                assert x.budget.reserved == z.budget.reserved == MAX_LENGTH
            assert await poll(lambda: x.budget.reserved == z.budget.reserved == 0, FREED_WITHIN_S)

    run(test)


def _ids_out_of_vocab(model: Model) -> dict[str, Any]:
    return wire.step_frame(0, True, torch.tensor([[5, model.vocab_size + 7]]), [], 0)


def _nan_hidden(model: Model) -> dict[str, Any]:
    hidden = torch.zeros(1, 3, model.hidden_size)
    hidden[0, 1, 5] = float("nan")
    return wire.step_frame(0, True, hidden, [], 0)


def _step_out_of_order(model: Model) -> dict[str, Any]:
    return wire.step_frame(1, True, torch.tensor([[5, 6]]), [], 0)


@pytest.mark.parametrize(
    ("held", "bad_step", "why"),
    [
        ((0, 2), _ids_out_of_vocab, "outside"),
        ((2, 4), _nan_hidden, "NaN"),
        ((0, 2), _step_out_of_order, "step 1"),
    ],
    ids=["ids-out-of-vocab-to-stage-0", "nan-hidden-to-last-stage", "step-out-of-order"],
)
def test_a_peer_sending_a_bad_step_is_banned_and_the_session_freed(
    model: Model,
    held: tuple[int, int],
    bad_step: Callable[[Model], dict[str, Any]],
    why: str,
) -> None:
    async def test() -> None:
        async with raw_peer() as (z, received), stage_nodes(model, (held, STAGE_TIMEOUTS)) as (s,):
            # Z coordinates a route where S serves `held` and Z the rest.
            if held[0] == 0:
                route, hop = [(s.peer_id, *held), (z.peer_id, held[1], NUM_LAYERS)], 0
            else:
                route, hop = [(z.peer_id, 0, held[0]), (s.peer_id, *held)], 1
            request = open_request(z.peer_id, route, {z.peer_id: tuple(z.addrs)}, hop=hop)
            await z.connect(s.host.addrs[0])
            async with await z.open_stream(s.peer_id, wire.STAGE_PROTOCOL) as stream:
                await stream.send(wire.open_frame(request))
                assert await poll(lambda: s.runtime.session_count == 1, 5.0)
                # S opened its session and dialed on: an `open` (hop 1) or its `ret`
                assert await poll(lambda: len(received) == 1, 5.0)
                assert received[0]["t"] == ("open" if hop == 0 else "ret")
                assert s.bans == []

                await stream.send(bad_step(model))
                assert await poll(lambda: s.bans != [], 5.0)
                assert [peer for peer, _ in s.bans] == [z.peer_id]
                assert why in s.bans[0][1]
                assert await poll(lambda: s.runtime.session_count == 0, FREED_WITHIN_S)
                # the failure went on downstream (towards the coordinator), naming Z
                assert await poll(lambda: len(received) == 2, 5.0)
                fail = wire.parse_fail(received[1])
                assert (fail.peer_id, fail.kind) == (z.peer_id, "bad")

    run(test)


def test_a_stage_host_closed_mid_session_fails_the_next_step_as_lost(model: Model) -> None:
    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y):
            async with closing(ring_over(x, y)) as ring:
                token = await first_token(ring)
                reply = await ring.step([token], want=True)
                assert reply.token is not None

                await y.stop()
                with trio.fail_after(RING_TIMEOUTS.step_s):  # well before any silence probe
                    with pytest.raises(StageFailedError) as info:
                        await ring.step([reply.token], want=True)
                assert info.value.kind == "lost"
                assert info.value.peer_id == y.peer_id
                assert await poll(lambda: x.runtime.session_count == 0, FREED_WITHIN_S)
            assert x.bans == []

    run(test)


@pytest.mark.parametrize("separate", [False, True], ids=["coordinator-is-stage-0", "coordinator-c"])
def test_a_lost_last_stage_is_blamed_not_the_stage_before_it(model: Model, separate: bool) -> None:
    """Y (2:4) goes away; X (0:2) notices, reports "Y lost" and ends; then the ring steps.

    With a separate coordinator C, blaming X would get an innocent stage banned.
    """

    async def test() -> None:
        specs = [((0, 2), STAGE_TIMEOUTS), ((2, 4), STAGE_TIMEOUTS), ((0, 4), STAGE_TIMEOUTS)]
        async with stage_nodes(model, *specs) as (x, y, c):
            ring = ring_over(x, y, coordinator=c if separate else None)
            async with closing(ring):
                token = await first_token(ring)

                await y.stop()
                assert await poll(lambda: x.runtime.session_count == 0, FREED_WITHIN_S)
                with pytest.raises(StageFailedError) as info:
                    await ring.step([token], want=True)
                who = {x.peer_id: "X", y.peer_id: "Y", c.peer_id: "C"}.get(info.value.peer_id)
                assert (who, info.value.kind) == ("Y", "lost"), str(info.value)

    run(test)


def test_a_last_stage_that_timed_out_is_not_blamed_as_bad(model: Model) -> None:
    """C coordinates Z (0:2, by hand: it forwards the open and stays quiet) -> Y (2:4).

    Y, idle past its timeout, frees the session and sends `end` to C on its return stream;
    C's next step must not call Y bad (the chain bans a "bad" stage).
    """

    async def test() -> None:
        specs = [((0, 4), STAGE_TIMEOUTS), ((2, 4), StageTimeouts(open_s=5.0, idle_s=0.3))]
        async with raw_peer() as (z, received), stage_nodes(model, *specs) as (c, y):
            route = [(z.peer_id, 0, 2), (y.peer_id, 2, NUM_LAYERS)]
            addrs = {z.peer_id: tuple(z.addrs), y.peer_id: y.addrs, c.peer_id: c.addrs}
            request = open_request(c.peer_id, route, addrs)
            await z.connect(y.host.addrs[0])
            async with closing(Ring(c.service, request, RING_TIMEOUTS, model.vocab_size)) as ring:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ring.open)
                    assert await poll(lambda: len(received) == 1, 5.0)  # C's open, for Z
                    assert received[0]["t"] == "open"
                    to_y = await z.open_stream(y.peer_id, wire.STAGE_PROTOCOL)
                    await to_y.send(wire.open_frame(replace(request, hop=1)))
                # the ring is open; nobody steps, and Y frees its session
                assert await poll(lambda: y.runtime.session_count == 1, 5.0)
                assert await poll(lambda: y.runtime.session_count == 0, FREED_WITHIN_S)
                with pytest.raises(StageFailedError) as info:
                    await ring.step(PROMPT, want=True)
                await to_y.close()
                assert info.value.kind != "bad", f"{info.value.peer_id == y.peer_id=}: {info.value}"

    run(test)
