"""The diagnostics report (`GET /api/admin/diagnostics`, `swarmd diagnostics`): one plain
text page that says who holds what, the route of the last requests, where their time
went and what failed.

Sections: this node, listen addresses, peers, models and shards, layer coverage, the last
requests, failures, sessions in flight. `build_report` gathers the facts from the node;
the `_section_*` functions only format them. Addresses and host names are replaced by
salted per-report tags (`swarmd.api.redact`) unless `full`, so a report can be pasted
into a bug report.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd import __version__
from swarmd.api.redact import Redactor
from swarmd.api.routing_view import covered, route_holders
from swarmd.dht.records import NodeRecord
from swarmd.model.layers import LayerRange
from swarmd.model.memory import available_memory_bytes, rss_bytes, total_memory_bytes
from swarmd.net.peers import PeerRow
from swarmd.net.relay import is_circuit
from swarmd.pipeline.placement import coverage, gaps
from swarmd.pipeline.report import Failure, RequestRecord

if TYPE_CHECKING:
    from swarmd.model.loader import LoadedModel
    from swarmd.model.runtime import StageRuntime
    from swarmd.node import Node
    from swarmd.pipeline.admission import KVBudget

MAX_REQUESTS = 50
MAX_FAILURES = 50


async def build_report(node: Node, holders: list[NodeRecord], full: bool) -> str:
    """`holders`: the records of every model of the swarm (of those this node holds first)."""
    connected, table, rejected, relayed = await node.peer_snapshot()
    now = time.time()
    # Read once, so every section tells of the same moment.
    ranges = _ranges(node, holders)
    banned = node.banned()
    routable = {m: _routable(node, m, r, holders, banned) for m, r in ranges.items()}
    requests = node.coordinator.ring.recent()[-MAX_REQUESTS:]
    failures = node.failures.recent()[-MAX_FAILURES:]
    sections = [
        _header(node, full),
        _section_summary(node, holders, ranges, connected, banned, requests, failures),
        _section_node(node),
        _section_addresses(node),
        _section_peers(node, holders, connected, relayed, table, rejected, now),
        _section_models(node),
        *(
            _section_coverage(node, model_id, ranges[model_id], routable[model_id])
            for model_id in ranges
        ),
        _section_requests(requests),
        _section_failures(failures),
        _section_sessions(node),
    ]
    text = "\n\n".join(sections) + "\n"
    if full:
        return text
    hosts = [socket.gethostname(), node.config.host, node.config.p2p_host]
    return Redactor(hosts=[h for h in hosts if h]).redact(text)


def _header(node: Node, full: bool) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    how = (
        "full: addresses kept"
        if full
        else "addresses and host names replaced by tags; --full keeps them"
    )
    return f"swarmd diagnostics of {node.identity.short_id} at {stamp} ({how})"


def _rows(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


@dataclass(frozen=True)
class ModelRanges:
    """Who holds which layers of one model (its ready holders; this node's own range)."""

    num_layers: int
    by_peer: dict[str, LayerRange]


def _ranges(node: Node, holders: list[NodeRecord]) -> dict[str, ModelRanges]:
    """Per model: the models this node holds first, then the others its records name."""
    out: dict[str, ModelRanges] = {}
    for model_id, held in node.held.items():
        mine = {node.identity.peer_id: held.model.layers}
        out[model_id] = ModelRanges(held.model.num_layers, mine)
    for r in holders:
        if r.state == "ready":
            entry = out.setdefault(r.model_id, ModelRanges(r.num_layers, {}))
            entry.by_peer.setdefault(r.peer_id, r.layers)
    return out


def _sitting_out(node: Node) -> str:
    outs = node.outs(time.time())
    return f", {len(outs)} lost and sitting out" if outs else ""


def _section_summary(
    node: Node,
    holders: list[NodeRecord],
    ranges: dict[str, ModelRanges],
    connected: list[str],
    banned: set[str],
    recent: list[RequestRecord],
    failures: list[Failure],
) -> str:
    """The first screen: who holds what, the last request's route and time, what failed."""
    lines = ["== Summary"]
    for model_id, held in ranges.items():
        missing = gaps(coverage(held.num_layers, held.by_peer.values()))
        cover = "complete" if not missing else "missing " + ", ".join(str(g) for g in missing)
        lines.append(
            f"swarm     {len(held.by_peer)} holder(s) of {model_id}: {cover}; "
            f"{len(connected)} peer(s) connected, {len(banned)} banned"
            f"{_sitting_out(node)}"
        )
    if not ranges:
        lines.append(
            f"swarm     no model found; {len(connected)} peer(s) connected, {len(banned)} banned"
            f"{_sitting_out(node)}"
        )
    if recent:
        r = recent[-1]
        speed = "" if r.tok_per_sec is None else f", {r.tok_per_sec:.1f} tok/s"
        stages = "/".join(f"{ms:.0f}" for ms in r.stage_ms)
        lines.append(
            f"last req  {r.request_id[:8]} {r.route} {','.join(r.nodes) or '-'}: "
            f"ttft {_ms(r.ttft_ms)} ms{speed}, stages {stages or '-'} ms, "
            f"total {_ms(r.total_ms)} ms, {r.outcome}"
            + (f" {r.error_type}" if r.error_type else "")
        )
    else:
        lines.append("last req  (none yet)")
    if failures:
        stamp = time.strftime("%H:%M:%S", time.localtime(failures[-1].at))
        lines.append(f"last fail {stamp} {failures[-1].line[:200]}")
    else:
        lines.append("last fail (none)")
    held = list(node.held.values())
    lines.append(
        f"in flight {node.coordinator.in_flight} request(s), "
        f"{sum(h.runtime.session_count for h in held)} stage session(s), KV cache "
        f"{sum(h.runtime.cached_tokens for h in held)} tokens"
    )
    return "\n".join(lines)


def _section_node(node: Node) -> str:
    torch = sys.modules.get("torch")  # a node holding no model never loads it
    rss = rss_bytes()
    state = node.swarm_state()
    loaded = f"torch {torch.__version__}" if torch is not None else "torch not loaded"
    threads = f"torch threads {node.torch_threads}" if torch is not None else "no torch"
    lines = [
        "== This node",
        f"peer id       {node.identity.peer_id} (short id {node.identity.short_id})",
        f"version       swarmd {__version__}, python {platform.python_version()}, {loaded}",
        f"device        {_device(torch)}, {threads}",
        f"memory        rss {_mb(rss)}, available {_mb(available_memory_bytes())} "
        f"of {_mb(total_memory_bytes())}",
        f"uptime        {time.monotonic() - node.started_at:.0f} s; swarm {state}",
    ]
    for h in node.held.values():
        model = h.model
        lines.append(
            f"model         {model.model_id} layers {model.layers} of {model.num_layers} "
            f"({model.weights} weights, {model.dtype_name} kernels, {model.backend}; "
            f"int4/int8 kernels: {model.kernels}; attention: {model.attention})"
        )
    if not node.held:
        lines.append("model         none held (--no-model): this node coordinates only")
    lines.append(f"api           {node.api_url or '-'}")
    for common in node.coordinated_models():
        v = common.variant
        lines.append(
            f"coordinates   {common.model_id} ({v.content_id[:16]}, {v.weights} weights, "
            f"{v.dtype_name}): no layers here, common files in {common.source.model_dir}"
        )
    return "\n".join(lines)


def _section_addresses(node: Node) -> str:
    addrs = list(node.swarm.addrs)
    lines = ["== Listen addresses", *(addrs or ["(the libp2p host is not running)"])]
    announced = node.listen_addrs()
    if announced != addrs:  # --announce-addr, or a relay: what peers are told to dial
        lines += ["announced as:", *announced]
    detail = node.swarm.reachability_detail
    lines.append(f"reachability: {detail or node.swarm.reachability}")
    relay = node.swarm.relay
    if relay is not None and (relay.punch.punched or relay.punch.failed):
        lines.append(
            f"hole punching: {relay.punch.punched} direct connection(s) made, "
            f"{relay.punch.failed} attempt(s) failed (their relay stays)"
        )
    return "\n".join(lines)


def _section_peers(
    node: Node,
    holders: list[NodeRecord],
    connected: Iterable[str],
    relayed: set[str],
    table: Iterable[PeerRow],
    rejected: dict[str, int],
    now: float,
) -> str:
    by_peer: dict[str, list[NodeRecord]] = {}
    for r in holders:
        by_peer.setdefault(r.peer_id, []).append(r)
    known = {row.peer_id: row for row in table}
    connected = set(connected)
    own = node.identity.peer_id
    ids = sorted((connected | set(known) | set(by_peer)) - {own})
    lines = [f"== Peers ({len(ids)} known, {len(connected)} connected)"]
    header = ["peer", "connected", "rtt ms", "ms/layer", "last seen", "serves", "failures"]
    rows = [[*header, "addresses"]]
    for peer_id in ids:
        row = known.get(peer_id)
        records = by_peer.get(peer_id, [])
        rtt = "-" if row is None or row.rtt_ms is None else f"{row.rtt_ms:.1f}"
        # Measured from the decode steps this node's routes ran there (the planner's cost).
        layer = "-" if row is None or row.layer_ms is None else f"{row.layer_ms:.2f}"
        seen = "-" if row is None or row.last_seen is None else f"{now - row.last_seen:.0f} s ago"
        serves = "; ".join(f"{r.model_id} {r.layers} ({r.state})" for r in records) or "-"
        failures = "0" if row is None else str(row.failures)
        signed = records[0].addrs if records else ()
        addrs = ",".join(signed or (row.addrs if row else ())) or "-"
        rows.append(
            [
                peer_id[-8:],
                _link(peer_id, connected, relayed, signed),
                rtt,
                layer,
                seen,
                serves,
                failures,
                addrs,
            ]
        )
    lines.append(_rows(rows) if ids else "(none)")
    bans = node.bans(now)
    for ban in bans:
        lines.append(f"banned {ban.peer_id[-8:]} for {ban.remaining_s:.0f} s more: {ban.reason}")
    if not bans:
        lines.append("bans: none")
    for out in node.outs(now):
        lines.append(
            f"sitting out {out.peer_id[-8:]} for {out.remaining_s:.0f} s more (lost, not "
            f"banned; asked again when no route does without it): {out.reason}"
        )
    refused = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()) if k != "accepted")
    lines.append(
        f"DHT records: {rejected.get('accepted', 0)} accepted, refused: {refused or 'none'}"
    )
    return "\n".join(lines)


def _section_models(node: Node) -> str:
    lines = ["== Models and shards"]
    for held in node.held.values():
        lines.extend(_model_files(held.model))
    if not node.held:
        lines.append("(none held)")
    return "\n".join(lines)


def _model_files(model: LoadedModel) -> list[str]:
    source = model.source
    lines = [f"{model.model_id} from {source.gguf or source.model_dir}"]
    manifest = source.manifest
    if manifest is None:
        lines.append(
            "  no manifest (a Hugging Face folder): weights not hash-checked; "
            "DHT records carry no content id"
        )
        return lines
    lines.append(f"  content id {manifest.content_id}")
    rows = [["  file", "bytes", "sha256", "state"]]
    for entry in manifest.files_for(model.layers):
        state = "verified at start"
        if source.file_path(entry.file) != source.model_dir / entry.file:
            state = f"{state} (the file {source.file_path(entry.file)}, hashed once)"
        rows.append([f"  {entry.file}", str(entry.bytes), entry.sha256, state])
    lines.append(_rows(rows))
    others = [s.file for s in manifest.shards if s not in manifest.shards_for(model.layers)]
    if others:
        lines.append(
            f"  other shards of the manifest (served to peers if present): {', '.join(others)}"
        )
    return lines


def _routable(
    node: Node, model_id: str, held: ModelRanges, holders: list[NodeRecord], banned: set[str]
) -> bool:
    """As `/v1/models` says it: a model held whole here, or one whose holders this node
    may use cover every layer (of one variant; one served without a manifest is
    routable only through a whole holder it is forwarded to)."""
    mine = node.held.get(model_id)
    if mine is not None:
        ranges = {p: (r.start, r.end) for p, r in held.by_peer.items()}
        return mine.model.is_whole or covered(held.num_layers, ranges, banned)
    ready = [r for r in holders if r.model_id == model_id and r.state == "ready"]
    if not ready:
        return False
    view = route_holders(node, model_id, ready)
    chosen = {r.peer_id: (r.layer_start, r.layer_end) for r in view.holders}
    return view.can_route and covered(held.num_layers, chosen, banned)


def _section_coverage(node: Node, model_id: str, held: ModelRanges, routable: bool) -> str:
    ranges = held.by_peer
    counts = coverage(held.num_layers, ranges.values())
    lines = [f"== Layer coverage of {model_id} ({held.num_layers} layers)"]
    for peer_id, layer_range in sorted(ranges.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        me = " (this node)" if peer_id == node.identity.peer_id else ""
        lines.append(f"  {layer_range!s:>9}  {peer_id[-8:]}{me}")
    missing = gaps(counts)
    if not missing:
        thinnest = min(counts)
        lines.append(f"complete: every layer has a holder (the fewest: {thinnest})")
    for gap in missing:
        lines.append(
            f"gap {gap}: no holder; fill it with: swarmd run --model {model_id} "
            f"--layers {gap} --bootstrap <an address above> (or --layers auto)"
        )
    lines.append(f"routable from this node: {'yes' if routable else 'no'}")
    return "\n".join(lines)


def _section_requests(records: list[RequestRecord]) -> str:
    lines = [f"== Last requests ({len(records)}, newest last)"]
    if not records:
        return "\n".join([*lines, "(none yet)"])
    rows = [
        [
            "finished",
            "request id",
            "route",
            "nodes",
            "queue",
            "sched",
            "ttft",
            "tok/s",
            "tokens",
            "stages ms",
            "total",
            "failovers",
            "outcome",
        ]
    ]
    for r in records:
        rows.append(
            [
                time.strftime("%H:%M:%S", time.localtime(r.finished_at)),
                r.request_id[:8],
                r.route,
                ",".join(r.nodes) or "-",
                _ms(r.queue_ms),
                _ms(r.sched_ms),
                _ms(r.ttft_ms),
                "-" if r.tok_per_sec is None else f"{r.tok_per_sec:.1f}",
                "-" if r.tokens is None else str(r.tokens),
                "/".join(f"{s:.0f}" for s in r.stage_ms) or "-",
                _ms(r.total_ms),
                "-" if r.failovers is None else str(r.failovers),
                r.outcome if r.error_type is None else f"{r.outcome} {r.error_type}",
            ]
        )
    return "\n".join([*lines, _rows(rows)])


def _section_failures(failures: list[Failure]) -> str:
    lines = [f"== Failures ({len(failures)}, newest last)"]
    if not failures:
        return "\n".join([*lines, "(none)"])
    for failure in failures:
        stamp = time.strftime("%H:%M:%S", time.localtime(failure.at))
        lines.append(f"{stamp} {failure.line}")
    return "\n".join(lines)


def _section_sessions(node: Node) -> str:
    lines = [
        "== Sessions in flight",
        f"coordinating {node.coordinator.in_flight} request(s), {node.coordinator.waiting} queued",
    ]
    for model_id, held in node.held.items():
        if len(node.held) > 1:
            lines.append(f"{model_id}:")
        lines.extend(_held_sessions(held.runtime, held.kv_budget))
    return "\n".join(lines)


def _held_sessions(runtime: StageRuntime, budget: KVBudget) -> list[str]:
    sessions = runtime.sessions()
    rows = runtime.batched_rows / runtime.batches if runtime.batches else 0.0
    lines = [
        f"stage sessions {len(sessions)} of {runtime.max_sessions}; KV budget "
        f"{budget.total:,} tokens, {budget.reserved:,} reserved, {runtime.cached_tokens:,} "
        "in use",
        f"batching: latest forward {runtime.last_batch} row(s), {rows:.1f} on average over "
        f"{runtime.batches:,} forwards",
        f"prefix cache: {runtime.prefix_hits:,} reuse(s), {runtime.prefix_reused_tokens:,} "
        f"prompt tokens not prefilled again; {runtime.prefix_held_tokens:,} of "
        f"{runtime.prefix_tokens:,} tokens held",
    ]
    for info in sessions:
        lines.append(f"  {info.session_id}  layers {info.layers}  {info.length} tokens")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _mb(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e6:.0f} MB"


def _device(torch: object | None) -> str:
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        return f"cuda ({cuda.get_device_name(0)})"
    return f"cpu ({_cpu_name()}, {os.cpu_count()} cores)"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _link(peer_id: str, connected: set[str], relayed: set[str], signed: tuple[str, ...]) -> str:
    """ "yes"; "yes (via relay)"; "yes (direct)" for a peer that announces only a relay yet
    holds a direct connection here (one it opened itself); or "no"."""
    if peer_id not in connected:
        return "no"
    if peer_id in relayed:
        return "yes (via relay)"
    if signed and all(is_circuit(a) for a in signed):
        return "yes (direct)"
    return "yes"
