"""A node's Prometheus metrics, in a registry of its own (tests can start several nodes per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class NodeMetrics:
    def __init__(self, block: int, model_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"block": str(block), "model": model_id}
        self.requests = Counter(
            "layerswarm_node_requests", "Requests received, by RPC", ["rpc"], registry=self.registry
        )
        self.errors = Counter(
            "layerswarm_node_errors", "Requests answered with an error, by status", ["code"], registry=self.registry
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
        # Generation (decoder blocks): the streams' caches (node/streams.py) and their steps.
        self.streams_open = Gauge(
            "layerswarm_node_streams_open", "Streams whose KV caches are held", registry=self.registry
        )
        self.cache_bytes = Gauge(
            "layerswarm_node_cache_bytes",
            "Bytes of keys and values booked for the held streams",
            registry=self.registry,
        )
        self.tokens_held = Gauge(
            "layerswarm_node_tokens_held", "Tokens in the held streams' caches", registry=self.registry
        )
        self.evictions = Counter(
            "layerswarm_node_stream_evictions",
            "Streams freed by the node, not by their caller (slots, bytes, idle, stream_ended)",
            ["reason"],
            registry=self.registry,
        )
        self.released = Counter(
            "layerswarm_node_streams_released", "Streams freed by their caller", registry=self.registry
        )
        self.steps = Counter(
            "layerswarm_node_decode_steps",
            "Decode requests computed, by kind (prefill, step, verify, kv_only)",
            ["kind"],
            registry=self.registry,
        )
        self.batch_steps = Counter(
            "layerswarm_node_decode_batch_steps",
            "Steps received in DecodeBatchStream messages (the messages: requests{rpc=DecodeBatchStream})",
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "layerswarm_node_decode_batch_size",
            "Streams whose steps ran in one block call (continuous batching)",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.info = Gauge(
            "layerswarm_node_info",
            "Constant 1, labelled with what this node serves",
            list(labels),
            registry=self.registry,
        )
        self.info.labels(**labels).set(1)
