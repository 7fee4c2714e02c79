"""A swarmd node that lies: it serves its layers but corrupts the hidden state it sends,
or blames an honest neighbour.

    python tests/e2e/hostile_node.py MODE run [swarmd run options]

MODE: `shape` (one column short), `dtype` (labelled float64) or `nan` (every value NaN);
`blame`: its stage answers every session's first step with a `fail` report naming its
next stage (the previous one when it is the last) as lost, and computes nothing;
`hangup`: at every session's first step its stage closes the stream to its next stage
and stays silent to the previous one, so the only report is the next stage's (true)
one that it hung up, while it still answers pings.
It also claims a huge throughput in its DHT record, so route planning prefers it to the
honest holders of the same layers. The fault lives here, in the tests, not in swarmd.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import torch
import trio

from swarmd.cli import app
from swarmd.pipeline import wire
from swarmd.pipeline.coordinator import Coordinator
from swarmd.pipeline.links import Link
from swarmd.pipeline.stage_service import HeldStage, StageService

MODES = ("shape", "dtype", "nan", "blame", "hangup")


def claim(self: Coordinator, model_id: str | None = None) -> float:
    """The throughput a hostile node claims in its records, so that routes take it."""
    return 1e6


def blame() -> None:
    async def forward(
        self: StageService,
        stage: HeldStage,
        up: Link,
        inbox: trio.MemoryReceiveChannel[Any],
        down: Link,
        req: wire.OpenRequest,
    ) -> None:
        await inbox.receive()  # the first step: answered with a lie
        victim = req.route[req.hop - 1].peer_id if req.is_last else req.next_peer
        why = f"stage {victim[-8:]} lost: connection reset"
        await up.send(wire.fail_frame(victim, why, "lost"))

    StageService._forward = forward  # type: ignore[method-assign]
    Coordinator.recent_tokens_per_second = claim  # type: ignore[method-assign]


def hang_up() -> None:
    async def forward(
        self: StageService,
        stage: HeldStage,
        up: Link,
        inbox: trio.MemoryReceiveChannel[Any],
        down: Link,
        req: wire.OpenRequest,
    ) -> None:
        await inbox.receive()  # the first step: never passed on
        await down.close()
        with trio.move_on_after(self.timeouts.idle_s):  # until the coordinator gives up
            async for _arrival in inbox:
                pass

    StageService._forward = forward  # type: ignore[method-assign]
    Coordinator.recent_tokens_per_second = claim  # type: ignore[method-assign]


def corrupt(mode: str) -> None:
    honest = wire.step_frame

    def step_frame(
        n: int,
        want: bool,
        inputs: torch.Tensor,
        stage_ms: list[float],
        activation_bytes: int,
        alone: bool = False,
    ) -> dict[str, Any]:
        frame = honest(n, want, inputs, stage_ms, activation_bytes, alone)
        if "h" not in frame:  # token ids: this node is not the one to lie here
            return frame
        tokens, width = frame["shape"]
        if mode == "shape":
            frame["shape"] = [tokens, width - 1]
            frame["h"] = frame["h"][: tokens * (width - 1) * 4]
        elif mode == "dtype":
            frame["dt"] = "float64"
        else:
            frame["h"] = struct.pack("<f", float("nan")) * (tokens * width)
        return frame

    wire.step_frame = step_frame  # type: ignore[assignment]
    Coordinator.recent_tokens_per_second = claim  # type: ignore[method-assign]


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: hostile_node.py {'|'.join(MODES)} run [options]")
    if sys.argv[1] == "blame":
        blame()
    elif sys.argv[1] == "hangup":
        hang_up()
    else:
        corrupt(sys.argv[1])
    sys.argv = ["swarmd", *sys.argv[2:]]
    app()
