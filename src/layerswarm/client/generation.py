"""Generation through a decoder family's coordinator (POST /v1/generate): request bodies, typed results and
the event stream, shared by the sync and async clients.

A streamed generation is server-sent events (read with httpx-sse): `token` events as tokens are drawn,
then `done` with the whole answer, or `error` if the stream could not go on (raised as SwarmError).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from httpx_sse import ServerSentEvent

from .results import SwarmError


class GenerateOptions(TypedDict, total=False):
    """Per-request options, as POST /v1/generate names them (coordinator/http/generate.py: GenerateJson;
    tests/coordinator/test_generation_swarm.py checks that the two list the same options)."""

    max_tokens: int
    temperature: float  # 0: greedy
    top_k: int
    top_p: float
    seed: int  # same seed, same text
    stop: str | list[str]
    order: Literal["sequential", "shuffle"]
    speculation: Literal["off", "auto"] | int | dict[str, int | str]  # drafts per verify trip (0: off)
    early_exit: Literal["off", "on"] | bool | float  # per-token early exit: on, or a threshold (lossy)


@dataclass(frozen=True)
class TokenEvent:
    """One drawn token: its text (may be empty while text is held back) and id (None: the end token)."""

    index: int | None
    text: str
    token_id: int | None


@dataclass(frozen=True)
class Generation:
    """A whole answer: text, ids, why it ended, the seed to send for the same text, and what the route went
    through (rebuilt and skipped hops; `trace` lists every event)."""

    id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    seed: int | None
    prompt_tokens: int
    completion_tokens: int
    tokens_per_s: float | None
    route: tuple[dict[str, Any], ...]
    rebuilt: int
    skipped: int
    trace: tuple[dict[str, Any], ...]
    trips: int = 0  # passes through the route (plain decoding: one per token)
    speculation: dict[str, Any] | None = None  # mode, draft depth, drafted, accepted, trips per token
    early_exit: dict[str, Any] | None = None  # mode, exits, block-hops (per token)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Generation:
        stream, usage = data["stream"], data["usage"]
        return cls(
            id=data["id"],
            text=data["text"],
            token_ids=tuple(data["token_ids"]),
            finish_reason=data["finish_reason"],
            seed=data["seed"],
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            tokens_per_s=stream["tokens_per_s"],
            route=tuple(stream["route"]),
            rebuilt=stream["rebuilt"],
            skipped=stream["skipped"],
            trace=tuple(data["trace"]),
            trips=stream.get("trips", 0),
            speculation=stream.get("speculation"),
            early_exit=stream.get("early_exit"),
        )


StreamEvent = TokenEvent | Generation  # tokens as they come, then the whole answer


def generate_body(prompt: str | Sequence[int], options: GenerateOptions, stream: bool) -> dict[str, Any]:
    key = "prompt" if isinstance(prompt, str) else "prompt_ids"
    value: str | list[int] = prompt if isinstance(prompt, str) else list(prompt)
    return {"json": {key: value, **options, "stream": stream}}


def parse_event(event: ServerSentEvent) -> StreamEvent:
    """A token, the final answer, or (raised) the error that ended the stream."""
    data = json.loads(event.data)
    if event.event == "token":
        return TokenEvent(data["index"], data["text"], data["token_id"])
    if event.event == "done":
        return Generation.from_json(data)
    if event.event == "error":
        raise SwarmError(503, str(data.get("error", "stream_failed")), data.get("detail"))
    raise SwarmError(502, "bad_event", f"unexpected event {event.event!r} in a generation stream")
