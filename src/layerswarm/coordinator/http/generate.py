"""POST /v1/generate: the native generation API of a decoder family (mounted only for one: app.py).

JSON in: {"prompt": "..."} or {"prompt_ids": [...]}, and max_tokens, temperature, top_k, top_p, seed,
stop, order (sequential | shuffle), speculation ("off", "auto", k, or {"k": k or "auto"}: the coordinator
drafts k tokens and the route verifies them in one trip; docs/speculation.md), early_exit ("off", "on" or
a threshold: a confident token leaves the route early, lossy), stream. Not streamed: one
JSON answer with the text, the token ids, the finish reason, usage, the seed used (send it back for the
same text), the route and the stream's trace (rebuilt, skipped, convicted hops). Streamed ("stream":
true): server-sent events (sse-starlette),

    event: token   data: {"index": 0, "text": "...", "token_id": 17}      one per sampled token
    event: done    data: {the non-streamed answer}                        last
    event: error   data: {"error": "stream_failed", "detail": "..."}      instead of done, if it broke

Errors before the stream starts are the native API's (errors.py): 422 for the request, 429 busy, 503
too few blocks. SSE rather than NDJSON: one format and one library for both generation APIs, with
keep-alive pings and a disconnect watch (a client that leaves frees the nodes' caches at once).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, TypedDict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message

from ..generation.options import (
    EarlyExit,
    GenerationOptions,
    InvalidGeneration,
    Speculation,
    parse_early_exit,
    parse_speculation,
)
from ..generation.runner import StreamFailed
from ..generation.session import StreamSession, StreamView, TraceEvent
from .bodies import BodySlots, read_json_object
from .errors import ApiError, describe
from .generation_run import ClientGone, Collected, GenerationRun
from .reading import JSON, content_type_of
from .service import Service

GENERATE_ROUTES = ("/v1/generate",)
MAX_PROMPT_CHARS = 200_000  # far past any context: a bound on tokenizer work, not the rule
MAX_BODY_BYTES = 1 << 20
PING_S = 15


class SpeculationK(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: StrictInt | Literal["auto", "off"]


SpeculationParam = Literal["off", "auto"] | StrictInt | SpeculationK | None
SPECULATION_HELP = (
    'self-speculative decoding: "off", "auto" (k adapts), k drafts per verify trip (0 to 16), or {"k": ...}; '
    "absent: the server's --speculation"
)


def speculation_of(value: SpeculationParam) -> Speculation | None:
    """The parameter as GenerationOptions takes it (None: the server's default). Raises InvalidGeneration."""
    if value is None:
        return None
    return parse_speculation(value.model_dump() if isinstance(value, SpeculationK) else value)


EarlyExitParam = Literal["off", "on"] | bool | float | None
EARLY_EXIT_HELP = (
    'per-token early exit (lossy): "off", "on" (the model\'s calibrated threshold) or a threshold over 0 and '
    "at most 1; not with speculation; absent: the server's --early-exit"
)


def early_exit_of(value: EarlyExitParam) -> EarlyExit | None:
    """The parameter as GenerationOptions takes it (None: the server's default). Raises InvalidGeneration."""
    return None if value is None else parse_early_exit(value)


def check_early_exit(value: object) -> object:
    """As check_speculation, for `early_exit`."""
    try:
        parse_early_exit(value)
    except InvalidGeneration as exc:
        raise ValueError(str(exc)) from None
    return value


def check_speculation(value: object) -> object:
    """A pydantic validator's body, before the type's own (whose union would say less): a bad value is
    the request's validation error, naming the field."""
    try:
        parse_speculation(value)
    except InvalidGeneration as exc:
        raise ValueError(str(exc)) from None
    return value


class GenerateJson(BaseModel):
    """What POST /v1/generate takes (anything else is refused: a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="text (the tokenizer adds <s>)")
    prompt_ids: list[int] | None = Field(None, max_length=65536, description="token ids, instead of prompt")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the server's)")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy")
    top_k: int = Field(0, ge=0, description="sample among the k most likely (0: all)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sample within this probability mass")
    seed: int | None = Field(None, ge=0, lt=2**63, description="same seed, same text (sampled)")
    stop: str | list[str] | None = Field(None, description="up to 4 sequences that end the text (not shown)")
    order: Literal["sequential", "shuffle"] = Field("sequential", description="block order (shuffle: robust families)")
    speculation: SpeculationParam = Field(None, description=SPECULATION_HELP)
    early_exit: EarlyExitParam = Field(None, description=EARLY_EXIT_HELP)
    stream: bool = Field(False, description="server-sent events: token, then done (or error)")

    _speculation = field_validator("speculation", mode="before")(check_speculation)
    _early_exit = field_validator("early_exit", mode="before")(check_early_exit)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateJson:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        return self

    def options(self) -> GenerationOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationOptions(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            order=self.order,
            speculation=speculation_of(self.speculation),
            early_exit=early_exit_of(self.early_exit),
        )


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateAnswer(TypedDict):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    seed: int | None
    usage: Usage
    stream: StreamView
    trace: list[TraceEvent]


def usage(session: StreamSession) -> Usage:
    prompt, completion = len(session.prompt), len(session.generated)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def answer(session: StreamSession, collected: Collected) -> GenerateAnswer:
    return {
        "id": session.request_id,
        "text": collected.text,
        "token_ids": collected.token_ids,
        "finish_reason": collected.finish_reason,
        "seed": session.options.seed,
        "usage": usage(session),
        "stream": session.view(),
        "trace": session.trace,
    }


def mount_generate(app: FastAPI, service: Service, slots: BodySlots) -> None:
    generator = service.generator

    @app.post("/v1/generate", responses={200: {"content": {"text/event-stream": {}}}, 422: {}, 429: {}, 503: {}})
    async def generate(request: Request) -> Response:
        """Generate text through the swarm (see the module's docs: JSON, or server-sent events)."""
        content_type_of(request, "prompt", accept=(JSON,))
        body = await read_json_object(slots, request, MAX_BODY_BYTES)
        try:
            params = GenerateJson.model_validate(body)
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", describe(exc.errors())) from exc
        prompt = params.prompt_ids if params.prompt_ids is not None else generator.encode(params.prompt or "")
        run = await GenerationRun.start(service, prompt, params.options())
        if params.stream:
            return event_stream(run, _events(run))
        try:
            collected = await run.collect(request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the front door counts it
        except StreamFailed as exc:
            raise ApiError(503, "stream_failed", str(exc)) from exc
        return JSONResponse(answer(run.session, collected))


def event_stream(run: GenerationRun, events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    """The events as a response. A client that leaves closes the run at once (its caches released),
    even before the events began: a generator never started has no finally to do it."""

    async def client_left(message: Message) -> None:
        await run.finish()

    headers = {"Cache-Control": "no-store"}
    return EventSourceResponse(events, ping=PING_S, headers=headers, client_close_handler_callable=client_left)


async def _events(run: GenerationRun) -> AsyncIterator[ServerSentEvent]:
    collected = Collected("")
    started = time.monotonic()
    try:
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for delta in deltas:
                collected.text += delta.text
                collected.finish_reason = delta.finish_reason
                if delta.token is not None:
                    collected.token_ids.append(delta.token)
                if delta.token is not None or delta.text:  # eos: no token, but text held back till then
                    index = len(collected.token_ids) - 1 if delta.token is not None else None
                    data: dict[str, Any] = {"index": index, "text": delta.text, "token_id": delta.token}
                    yield ServerSentEvent(json.dumps(data), event="token")
    except StreamFailed as exc:
        error = {"error": "stream_failed", "detail": str(exc), "after_s": round(time.monotonic() - started, 3)}
        yield ServerSentEvent(json.dumps(error), event="error")
        return
    yield ServerSentEvent(json.dumps(answer(run.session, collected)), event="done")
