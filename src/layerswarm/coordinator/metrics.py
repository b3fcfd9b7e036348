"""The coordinator's Prometheus metrics (its own registry, exposed at GET /metrics)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from layerswarm.wire.memory import malloc_usage

from .membership.records import NodeState
from .membership.registry import Registry
from .routing.ensemble import EnsembleResult
from .routing.trace import PathResult
from .verification.verifier import VerifyStats

BLOCK_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Checked(Protocol):
    """A verifier's counters (verification/: the classifiers' Verifier, the decoders' DecodeVerifier)."""

    @property
    def counters(self) -> VerifyStats: ...


class _SwarmCollector(Collector):
    """Node counts by state, read from the registry at scrape time (never stale)."""

    def __init__(self, registry: Registry) -> None:
        self.swarm = registry

    def collect(self) -> Iterable[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("layerswarm_nodes", "Known nodes by state", labels=["state"])
        for state in NodeState:
            gauge.add_metric([state.value], sum(1 for r in self.swarm.nodes.values() if r.state is state))
        yield gauge
        depth = GaugeMetricFamily("layerswarm_reachable_depth", "Distinct block indices routable now")
        depth.add_metric([], self.swarm.reachable_depth())
        yield depth
        # Per block index, so an alert can say which one lost its spare (deploy/prometheus/alerts.yml).
        per_block = GaugeMetricFamily("layerswarm_block_nodes", "Routable nodes per block index", labels=["block"])
        routable = self.swarm.routable_by_block()
        for block in range(self.swarm.family.depth):
            per_block.add_metric([str(block)], len(routable.get(block, ())))
        yield per_block
        # Beside it, so an alert can compare the two without knowing the model (deploy/prometheus/alerts.yml).
        yield GaugeMetricFamily("layerswarm_model_depth", "Blocks in the served model", self.swarm.family.depth)


class _VerifyCollector(Collector):
    """The verifier's own counters, read at scrape time: what an operator alerts on when a device on
    the LAN starts lying (a rise in convictions) or when checks cost more than expected."""

    def __init__(self, verifier: Checked) -> None:
        self.verifier = verifier

    def collect(self) -> Iterable[CounterMetricFamily]:
        c = self.verifier.counters
        hops = CounterMetricFamily(
            "layerswarm_verify_hops",
            "Hops the verifier saw, by what it did: seen (every hop), reexecuted (on the coordinator), "
            "reexecuted_on_peers (on replicas), flagged_by_range (outside the evaluated activation range), "
            "deferred (re-executed while the path went on)",
            labels=["kind"],
        )
        for kind, value in (
            ("seen", c.hops),
            ("reexecuted", c.reexecuted),
            ("reexecuted_on_peers", c.peer_reexecuted),
            ("flagged_by_range", c.flagged),
            ("deferred", c.deferred),
        ):
            hops.add_metric([kind], value)
        yield hops
        yield CounterMetricFamily(
            "layerswarm_verify_convictions", "Nodes caught returning wrong activations (quarantined)", c.convicted
        )
        yield CounterMetricFamily(
            "layerswarm_verify_rewinds",
            "Paths rewound to a hop whose deferred check failed (its later hops rerun)",
            c.rewinds,
        )
        yield CounterMetricFamily(
            "layerswarm_verify_unresolved",
            "Replica against replica with no second opinion: nobody convicted",
            c.unresolved,
        )


class _MemoryCollector(Collector):
    """Where the process's memory is, read at scrape time: Python's small objects (pymalloc blocks) and
    glibc's heap (bytes in use, bytes freed but kept). A soak tells a leak (in use rising) from the
    allocator keeping freed pages (free rising) with these, beside RSS (wire/memory.py)."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "layerswarm_python_blocks", "Python objects' small blocks allocated now", sys.getallocatedblocks()
        )
        usage = malloc_usage()
        if usage is None:  # not glibc: nothing to say
            return
        heap = GaugeMetricFamily("layerswarm_malloc_bytes", "glibc heap bytes, all arenas", labels=["kind"])
        heap.add_metric(["in_use"], usage["in_use"])
        heap.add_metric(["free"], usage["free"])
        yield heap


class CoordinatorMetrics:
    def __init__(self, swarm: Registry, verifier: Checked | None = None, generative: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "layerswarm_requests",
            "HTTP requests by route and status, every answer "
            '(499: the client went away first; endpoint "unrouted": refused before routing, 401)',
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "layerswarm_http_connections_closed",
            "HTTP connections the coordinator closed: header_timeout, body_timeout, write_timeout, header_too_large, "
            "ambiguous_framing, too_many_connections, stalled_reader_evicted, idle_evicted",
            ["reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge("layerswarm_http_in_flight", "Admitted inference requests", registry=self.registry)
        self.body_reads = Gauge("layerswarm_http_body_reads", "Request bodies being read", registry=self.registry)
        self.decoding = Gauge(
            "layerswarm_http_decoding", "Images being decoded, by worker lane", ["lane"], registry=self.registry
        )
        self.latency = Histogram(
            "layerswarm_request_seconds",
            "End-to-end classification latency",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.hops = Counter("layerswarm_hops", "Hops by outcome", ["outcome"], registry=self.registry)
        self.early_exits = Counter(
            "layerswarm_early_exits", "Requests that stopped early, confident", registry=self.registry
        )
        self.exits_by_rule = Counter(
            "layerswarm_exits", "Requests that exited early, by exit rule", ["rule"], registry=self.registry
        )
        self.blocks_per_request = Histogram(
            "layerswarm_blocks_per_request",
            "Blocks run per request, all routes together",
            buckets=BLOCK_BUCKETS,
            registry=self.registry,
        )
        self.ensemble_routes = Counter(
            "layerswarm_ensemble_routes", "Routes run for ensembles, by outcome", ["outcome"], registry=self.registry
        )
        self.anytime_answers = Counter(
            "layerswarm_anytime_answers", "Requests answered early because of their deadline", registry=self.registry
        )
        self.relay_chains = Counter(
            "layerswarm_relay_chains",
            "Relay chains by how they ended: completed, handed_back (a node failed or refused; the request "
            "went on from its last good activation), discarded (the trace or result did not check: digest, "
            "signature, range; someone lied), not_started (the first node refused or was unreachable)",
            ["outcome"],
            registry=self.registry,
        )
        self.relay_handbacks = Counter(
            "layerswarm_relay_handbacks",
            "Relay hand-backs by how the coordinator's own forward of the handed-back activation to the node "
            "they named turned out: confirmed (no answer in the hop timeout), contradicted (it answered: "
            "counted against the node that handed back), unchecked (too many probes running, or it left), "
            "discounted (the node that handed back was given limits the chain cannot have given: not probed)",
            ["outcome"],
            registry=self.registry,
        )
        self.node_transitions = Counter(
            "layerswarm_node_transitions",
            "Node state changes by the state entered (quarantined: caught lying or malformed; ejected: "
            "failing; ignored: refused to admit us; forgotten: gone from the registry)",
            ["to"],
            registry=self.registry,
        )
        self._generation_metrics(self.registry if generative else None)
        self.registry.register(_SwarmCollector(swarm))
        self.registry.register(_MemoryCollector())
        if verifier is not None:
            self.registry.register(_VerifyCollector(verifier))

    def _generation_metrics(self, registry: CollectorRegistry | None) -> None:
        """A decoder family's streams (generation/); exposed only where one is served (registry None)."""
        self.streams = Counter(
            "layerswarm_gen_streams",
            "Generation streams by how they ended: finished (stop or length), failed (no way on), abandoned "
            "(the client went away first)",
            ["outcome"],
            registry=registry,
        )
        self.live_streams = Gauge("layerswarm_gen_live_streams", "Generation streams open now", registry=registry)
        self.gen_tokens = Counter("layerswarm_gen_tokens", "Tokens generated, all streams", registry=registry)
        self.gen_failovers = Counter(
            "layerswarm_gen_failovers",
            "Hops of live streams that failed over: rebuilt (the cache replayed on another node, or on the same "
            "node after it lost it), skipped (the block left the stream's route, within the minimum depth)",
            ["kind"],
            registry=registry,
        )
        self.gen_trips = Counter(
            "layerswarm_gen_route_trips",
            "Passes of finished streams through their route (prefill, plain steps, speculative verifies): over "
            "layerswarm_gen_tokens_total, the trips per token (plain decoding: 1)",
            registry=registry,
        )
        self.gen_drafted = Counter(
            "layerswarm_gen_drafted_tokens",
            "Tokens the coordinator drafted for speculative verify trips",
            registry=registry,
        )
        self.gen_accepted = Counter(
            "layerswarm_gen_accepted_tokens", "Drafted tokens the route's verify kept", registry=registry
        )
        self.gen_block_hops = Counter(
            "layerswarm_gen_block_hops",
            "Decode calls of finished streams, every pass through their route: over layerswarm_gen_tokens_total, "
            "the block-hops per token (plain decoding: the route's depth; early exit: less)",
            registry=registry,
        )
        self.gen_exits = Counter(
            "layerswarm_gen_early_exits", "Tokens that left their route early (per-token early exit)", registry=registry
        )
        self.gen_step = Histogram(
            "layerswarm_gen_step_seconds",
            "One generated token's trip: stem, every hop, head",
            buckets=STEP_BUCKETS,
            registry=registry,
        )

    def stream_opened(self) -> None:
        self.live_streams.inc()

    def stream_closed(self, outcome: str, tokens: int) -> None:
        self.live_streams.dec()
        self.streams.labels(outcome).inc()
        self.gen_tokens.inc(tokens)

    def token_step(self, seconds: float) -> None:
        self.gen_step.observe(seconds)

    def failover(self, kind: str) -> None:
        self.gen_failovers.labels(kind).inc()

    def speculation_round(self, drafted: int, accepted: int) -> None:
        self.gen_drafted.inc(drafted)
        self.gen_accepted.inc(accepted)

    def route_trips(self, trips: int) -> None:
        self.gen_trips.inc(trips)

    def block_hops(self, hops: int, exits: int) -> None:
        self.gen_block_hops.inc(hops)
        self.gen_exits.inc(exits)

    def observe_route(self, path: PathResult) -> None:
        """One route's hops by outcome, and how each of its relay chains ended (star routes have none)."""
        for hop in (*path.hops, *path.discarded):
            self.hops.labels(hop.outcome).inc()
        self.observe_chains(path)

    def observe_chains(self, path: PathResult) -> None:
        """How each relay chain of one route ended (star routes have none)."""
        ended_early = [handback["kind"] for handback in path.handbacks]
        self.relay_chains.labels("completed").inc(max(path.chains - len(ended_early), 0))
        for kind in ended_early:
            self.relay_chains.labels(kind).inc()

    def observe_handback(self, outcome: str) -> None:
        """How one hand-back's claim turned out (relay/handbacks.py)."""
        self.relay_handbacks.labels(outcome).inc()

    def observe(self, result: EnsembleResult, exit_rule: str | None) -> None:
        """Adaptive-compute figures of one answered request."""
        self.blocks_per_request.observe(sum(r.path.depth for r in result.routes))
        if exit_rule is not None:
            self.early_exits.inc()
            self.exits_by_rule.labels(exit_rule).inc()
        if any(r.path.anytime for r in result.routes):
            self.anytime_answers.inc()
        if result.requested > 1:
            self.ensemble_routes.labels("ok").inc(len(result.routes))
            self.ensemble_routes.labels("failed").inc(len(result.failed))
