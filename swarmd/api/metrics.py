"""`NodeMetrics`: the node's Prometheus metrics, served at `GET /metrics`.

Counters and histograms are updated where things happen (a finished request, a stage
forward pass); the figures that are state rather than events (peers connected, KV-cache
tokens, bytes per protocol, records rejected, bans) are read from the node when scraped.
Each node has its own registry, so several nodes in one process (tests) never mix.

Names (all `swarmd_`): requests_total{outcome}, prompt_tokens_total,
generated_tokens_total, ttft_seconds, inter_token_seconds, failovers_total,
stage_forward_seconds, peers_connected, kv_cache_tokens, sessions, in_flight_requests,
bytes_sent_total{protocol}, bytes_received_total{protocol}, records_rejected_total{reason},
peers_banned, peers_sitting_out, file_bytes_served_total, background_errors_total{loop},
swarm_joining, reachability{state}, info{version,peer_id,model}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from swarmd.pipeline.report import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass
class NodeState:
    """What the scrape reads from the node; each a callable so it is read when asked."""

    info: Callable[[], dict[str, str]]
    peers_connected: Callable[[], int]
    kv_cache_tokens: Callable[[], int]
    sessions: Callable[[], int]
    in_flight: Callable[[], int]
    bytes_sent: Callable[[], dict[str, int]]
    bytes_received: Callable[[], dict[str, int]]
    records_rejected: Callable[[], dict[str, int]]
    peers_banned: Callable[[], int]
    peers_sitting_out: Callable[[], int] = field(default=lambda: 0)
    file_bytes_served: Callable[[], int] = field(default=lambda: 0)
    kv_budget_tokens: Callable[[], int] = field(default=lambda: 0)
    kv_reserved_tokens: Callable[[], int] = field(default=lambda: 0)
    queued_requests: Callable[[], int] = field(default=lambda: 0)
    batch_rows: Callable[[], int] = field(default=lambda: 0)
    forwards: Callable[[], int] = field(default=lambda: 0)
    forward_rows: Callable[[], int] = field(default=lambda: 0)
    background_errors: Callable[[], dict[str, int]] = field(default=dict)  # by loop
    http_connections: Callable[[], int] = field(default=lambda: 0)
    http_refused: Callable[[], dict[str, int]] = field(default=dict)  # by reason
    joining: Callable[[], bool] = field(default=lambda: False)
    reachability: Callable[[], str] = field(default=lambda: "unknown")


class NodeMetrics:
    def __init__(self, state: NodeState) -> None:
        # No auto_describe: it would run the state collector now, before the node is built.
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.requests = Counter(
            "swarmd_requests", "Finished requests, by outcome", ["outcome"], registry=reg
        )
        self.prompt_tokens = Counter(
            "swarmd_prompt_tokens", "Prompt tokens of requests this node coordinated", registry=reg
        )
        self.generated_tokens = Counter(
            "swarmd_generated_tokens", "Tokens generated for requests coordinated", registry=reg
        )
        histograms = {
            "ttft": ("Time from receipt to the first token", _LATENCY_BUCKETS),
            "inter_token": ("Time between two tokens of one reply", _TOKEN_BUCKETS),
            "stage_forward": (
                "One forward pass of this node's layers (a prompt chunk or one token)",
                _FORWARD_BUCKETS,
            ),
        }
        made = {
            key: Histogram(f"swarmd_{key}_seconds", doc, buckets=buckets, registry=reg)
            for key, (doc, buckets) in histograms.items()
        }
        self.ttft, self.inter_token = made["ttft"], made["inter_token"]
        self.stage_forward = made["stage_forward"]
        self.failovers = Counter(
            "swarmd_failovers", "Stages replaced in the middle of a request", registry=reg
        )
        reg.register(_StateCollector(state))
        for outcome in ("ok", "error"):
            self.requests.labels(outcome)  # both series exist from the start, at 0

    def observe_request(self, record: RequestRecord, token_gaps_s: list[float]) -> None:
        self.requests.labels(record.outcome).inc()
        if record.prompt_tokens:
            self.prompt_tokens.inc(record.prompt_tokens)
        if record.tokens:
            self.generated_tokens.inc(record.tokens)
        if record.ttft_ms is not None:
            self.ttft.observe(record.ttft_ms / 1000.0)
        for gap in token_gaps_s:
            self.inter_token.observe(gap)
        if record.failovers:
            self.failovers.inc(record.failovers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, state: NodeState) -> None:
        self._state = state

    def collect(self) -> Iterator[InfoMetricFamily | GaugeMetricFamily | CounterMetricFamily]:
        s = self._state
        yield InfoMetricFamily("swarmd", "This node", value=s.info())
        yield _gauge("swarmd_peers_connected", "Peers with an open connection", s.peers_connected())
        yield _gauge(
            "swarmd_kv_cache_tokens", "Tokens held in this node's KV caches", s.kv_cache_tokens()
        )
        yield _gauge("swarmd_sessions", "Stage sessions open on this node", s.sessions())
        yield _gauge(
            "swarmd_in_flight_requests", "Requests this node is coordinating", s.in_flight()
        )
        yield _gauge("swarmd_peers_banned", "Peers banned right now", s.peers_banned())
        yield _gauge(
            "swarmd_peers_sitting_out",
            "Peers lost lately, left out of routes while others serve",
            s.peers_sitting_out(),
        )
        yield _gauge(
            "swarmd_kv_budget_tokens",
            "KV cache tokens this node holds in all",
            s.kv_budget_tokens(),
        )
        yield _gauge(
            "swarmd_kv_reserved_tokens",
            "KV tokens reserved by sessions (prompt + max_tokens each)",
            s.kv_reserved_tokens(),
        )
        yield _gauge(
            "swarmd_queued_requests", "Requests waiting for a slot or KV room", s.queued_requests()
        )
        yield _gauge("swarmd_batch_rows", "Session steps in the latest forward", s.batch_rows())
        forwards = CounterMetricFamily("swarmd_forwards", "Stage forwards run (batches)")
        forwards.add_metric([], s.forwards())
        yield forwards
        rows = CounterMetricFamily("swarmd_forward_rows", "Session steps run in those forwards")
        rows.add_metric([], s.forward_rows())
        yield rows
        yield _counter_by("swarmd_bytes_sent", "Bytes sent to peers", "protocol", s.bytes_sent())
        yield _counter_by(
            "swarmd_bytes_received", "Bytes received from peers", "protocol", s.bytes_received()
        )
        yield _counter_by(
            "swarmd_records_rejected", "DHT records refused", "reason", s.records_rejected()
        )
        served = CounterMetricFamily("swarmd_file_bytes_served", "Model file bytes sent to peers")
        served.add_metric([], s.file_bytes_served())
        yield served
        yield _counter_by(
            "swarmd_background_errors",
            "Rounds of a swarm background loop that failed (the loop went on)",
            "loop",
            s.background_errors(),
        )
        yield _gauge("swarmd_http_connections", "Open API connections", s.http_connections())
        yield _gauge(
            "swarmd_swarm_joining",
            "1 while no peer answers (bootstrap peers down, or every peer lost)",
            int(s.joining()),
        )
        reachability = GaugeMetricFamily(
            "swarmd_reachability",
            "1 for whether peers can dial this node: public, private (a relay), unknown",
            labels=["state"],
        )
        current = s.reachability()
        for state in ("public", "private", "unknown"):
            reachability.add_metric([state], int(state == current))
        yield reachability
        yield _counter_by(
            "swarmd_http_refused",
            "API connections or requests refused at the edge (caps, deadlines, auth, origin)",
            "reason",
            s.http_refused(),
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter_by(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
