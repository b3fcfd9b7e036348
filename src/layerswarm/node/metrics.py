"""A node's Prometheus metrics, in a registry of its own (tests can start several nodes per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class NodeMetrics:
    def __init__(self, block: int, model_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"block": str(block), "model": model_id}
        self.requests = Counter(
            "layerswarm_node_requests", "Forward requests received", ["rpc"], registry=self.registry
        )
        self.errors = Counter(
            "layerswarm_node_errors", "Forward requests answered with an error", ["code"], registry=self.registry
        )
        self.refused_outputs = Counter(
            "layerswarm_node_refused_outputs",
            "Block outputs not sent: non-finite, or out of range for the reply dtype",
            registry=self.registry,
        )
        self.latency = Histogram(
            "layerswarm_node_forward_seconds",
            "Block compute time per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge("layerswarm_node_in_flight", "Requests queued or computing", registry=self.registry)
        self.info = Gauge(
            "layerswarm_node_info",
            "Constant 1, labelled with what this node serves",
            list(labels),
            registry=self.registry,
        )
        self.info.labels(**labels).set(1)
