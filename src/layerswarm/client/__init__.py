"""A Python client for a layerswarm coordinator (sync and async, over httpx, typed results).

    from layerswarm.client import SwarmClient

    # api_key: one line of the coordinator's --api-key-file (leave it out when the API has no keys)
    with SwarmClient("http://127.0.0.1:8080", api_key=key) as swarm:
        result = swarm.classify("image.png", top_k=3, policy="shuffle", deadline_ms=200)
        print(result.prediction, result.depth, [h.block for h in result.trace.hops])

    # a decoder family's coordinator: text through the swarm, token by token, then the whole answer
    with SwarmClient("http://127.0.0.1:8080") as swarm:
        for event in swarm.generate_stream("12+34=", max_tokens=8, seed=1):
            if isinstance(event, TokenEvent):
                print(event.text, end="", flush=True)
            else:
                print(f"\n{event.completion_tokens} tokens, {event.rebuilt} hops rebuilt, {event.skipped} skipped")

Connect errors, 429 (busy) and 503 (too few blocks reachable right now) are retried with exponential
backoff and jitter (tenacity); other errors raise SwarmError at once. Given several coordinators
(`SwarmClient([url_a, url_b])`), a retry goes to the next one at once; see ClientBase.
"""

from .asynchronous import AsyncSwarmClient
from .bodies import ImageInput, Options
from .generation import GenerateOptions, Generation, StreamEvent, TokenEvent
from .results import (
    Attempt,
    BatchClassification,
    Classification,
    Hop,
    ItemResult,
    Label,
    Node,
    SwarmError,
    SwarmView,
    Trace,
)
from .sync import SwarmClient

__all__ = [
    "AsyncSwarmClient",
    "Attempt",
    "BatchClassification",
    "Classification",
    "GenerateOptions",
    "Generation",
    "Hop",
    "ImageInput",
    "ItemResult",
    "Label",
    "Node",
    "Options",
    "StreamEvent",
    "SwarmClient",
    "SwarmError",
    "SwarmView",
    "TokenEvent",
    "Trace",
]
