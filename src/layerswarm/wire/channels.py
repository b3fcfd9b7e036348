"""The options of every long-lived gRPC channel to a node: the coordinator's clients and a node's relay
peers. In one place, so both ends of the swarm reconnect the same way."""

from __future__ import annotations

from typing import Any

PEER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    # A dead peer is noticed between calls too, within about 3 s.
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),  # the caller decides what to retry, and where
    # A peer that comes back after an outage is reached within about a second. gRPC's own reconnect
    # backoff starts at 1 s and grows 1.6x an attempt up to 2 minutes, so a channel that kept trying a
    # node through a restart refused calls for seconds after the node answered again (2.3-3.4 s after a 6 s
    # outage here; 0.7-0.9 s with these: tests/wire/test_channels.py).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
