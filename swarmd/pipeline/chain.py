"""Stage chains: the coordinator's view of a route, as `open` / `step` / `close`.

`LocalChain` (local.py) is the route of one stage this node holds whole; remote chains
over libp2p implement the same three calls. No torch here: a node holding no layers plans
and runs routes with these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from swarmd.model.layers import LayerRange
from swarmd.model.sampling import Sampled, SamplingParams


@dataclass(frozen=True)
class Hop:
    short_id: str  # the node's short id (last 8 chars of its peer id)
    layers: LayerRange
    relayed: bool = False  # the node is reached through a circuit relay


def route_kind(chain: StageChain) -> str:
    """What the DIAG line and `x-swarm-route` say: "local" (this node alone),
    "distributed", or "relayed" (a distributed route with a stage behind a relay)."""
    if chain.is_local:
        return "local"
    return "relayed" if any(hop.relayed for hop in chain.hops) else "distributed"


class StageChain(Protocol):
    hops: list[Hop]  # the route now (after a failover, the new one)
    failovers: int

    @property
    def is_local(self) -> bool:
        """True when this node runs every layer itself."""
        ...

    async def open(
        self,
        session_id: str,
        max_length: int,
        sampling: SamplingParams,
        prompt: list[int],
        share: str | None = None,
    ) -> int:
        """Open the session; how many leading prompt tokens its caches already hold.
        `share`: the session of another reply to the same prompt, whose caches may be
        copied instead of prefilling again."""
        ...

    async def step(self, token_ids: list[int], want_token: bool) -> Sampled | None:
        """Feed tokens; the next token (and its logprobs, if asked) when `want_token`."""
        ...

    async def prefill(self, chunks: list[list[int]], before_each: Callable[[], None]) -> Sampled:
        """Feed the prompt's chunks (`before_each()` runs before each, and may raise to
        stop); the token after the last. A route of several stages keeps several chunks
        in flight, one behind the other."""
        ...

    async def close(self) -> None: ...

    def stage_seconds(self) -> list[float]: ...

    def activation_bytes(self) -> int: ...
