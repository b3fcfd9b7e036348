"""The OpenAI-compatible API of a decoder family (mounted only for one: app.py), for the official `openai`
package and anything that speaks its wire format:

    GET  /v1/models              the one model served (its directory name; its model id works too)
    POST /v1/completions         prompt: a string (or a list of one), or token ids
    POST /v1/chat/completions    messages, through the chat template (chat.py)

Parameters: model, max_tokens (chat: or max_completion_tokens), temperature (0 to 2; default 1),
top_p, top_k (an extra), seed (same seed, same text), stop (up to 4), stream with stream_options
include_usage, n (1 only), user; `order` (sequential | shuffle) is an extra: the route's block order, and
so is `speculation` ("off", "auto", k or {"k": ...}: drafts verified k at a time; docs/speculation.md), and
`early_exit` ("off", "on" or a threshold: confident tokens leave the route early, lossy).
What this server does not do (n > 1, logprobs, echo, best_of, suffix, penalties, logit_bias, tools,
response formats) is a 400 naming the parameter; an unknown parameter is a 400 too. Streams are
server-sent events (sse-starlette): `data: {chunk}` lines, then `data: [DONE]`; an error after the stream
started is one `data: {"error": {...}}` and the end. Every answer carries `usage`, and an extra
`layerswarm` object: the seed used, the route, tokens per second and the stream's trace (rebuilt,
skipped, convicted hops). Errors: openai_errors.py, the one place they are mapped.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import ServerSentEvent

from ..generation.options import GenerationOptions
from ..generation.session import StreamSession
from .bodies import BodySlots, read_json_object
from .chat import CHAT_STOPS, Message, render
from .generate import (
    EARLY_EXIT_HELP,
    SPECULATION_HELP,
    EarlyExitParam,
    SpeculationParam,
    check_early_exit,
    check_speculation,
    early_exit_of,
    event_stream,
    speculation_of,
    usage,
)
from .generation_run import ClientGone, GenerationRun
from .openai_errors import MAPPED, OpenAIError, as_openai_error, error_event, install_openai_errors
from .service import Service

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 1 << 20
MAX_PROMPT_CHARS = 200_000
OPENAI_MAX_STOPS = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CommonParams(BaseModel):
    """What both endpoints take. Fields OpenAI defines that this server does not act on are refused when set
    to anything but their neutral value (`unsupported`), and unknown fields are refused by pydantic."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    order: Literal["sequential", "shuffle"] = "sequential"
    speculation: SpeculationParam = Field(None, description=SPECULATION_HELP)
    early_exit: EarlyExitParam = Field(None, description=EARLY_EXIT_HELP)

    _speculation = field_validator("speculation", mode="before")(check_speculation)
    _early_exit = field_validator("early_exit", mode="before")(check_early_exit)

    def unsupported(self) -> list[tuple[str, bool]]:
        """(parameter, set to something this server does not do)."""
        return [
            ("n", (self.n or 1) > 1),
            ("presence_penalty", bool(self.presence_penalty)),
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("logit_bias", bool(self.logit_bias)),
        ]

    def options(self, max_tokens: int | None, extra_stops: tuple[str, ...] = ()) -> GenerationOptions:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > OPENAI_MAX_STOPS:
            raise OpenAIError(400, f"stop: at most {OPENAI_MAX_STOPS} sequences", "stop", "invalid_value")
        return GenerationOptions(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stops + extra_stops,
            order=self.order,
            speculation=speculation_of(self.speculation),
            early_exit=early_exit_of(self.early_exit),
        )


class CompletionBody(CommonParams):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        more = [
            ("echo", bool(self.echo)),
            ("best_of", (self.best_of or 1) > 1),
            ("suffix", bool(self.suffix)),
            ("logprobs", self.logprobs is not None),
        ]
        return super().unsupported() + more


class ChatBody(CommonParams):
    messages: list[Message] = Field(..., min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        more = [
            ("logprobs", bool(self.logprobs)),
            ("top_logprobs", self.top_logprobs is not None),
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none")),
            ("response_format", (self.response_format or {}).get("type", "text") != "text"),
        ]
        return super().unsupported() + more


def mount_openai(app: FastAPI, service: Service, slots: BodySlots) -> None:
    install_openai_errors(app)
    generator, manifest = service.generator, service.manifest
    name = service.settings.model_dir.name
    names = {name, manifest.model_id}
    created = int(time.time())

    async def body_of(request: Request, model: type[CommonParams]) -> Any:
        try:
            body = await read_json_object(slots, request, MAX_BODY_BYTES)
            params = model.model_validate(body)
        except MAPPED as exc:
            raise as_openai_error(exc) from exc
        if params.model not in names:
            raise OpenAIError(
                404,
                f"The model `{params.model[:64]}` does not exist; this server has `{name}`",
                "model",
                "model_not_found",
            )
        for param, unsupported in params.unsupported():
            if unsupported:
                raise OpenAIError(400, f"{param} is not supported by this server", param, "unsupported_parameter")
        return params

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        """The model this coordinator serves (OpenAI's list format)."""
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "layerswarm"}],
        }

    @app.get("/v1/models/{model}", tags=["openai"])
    async def model(model: str) -> dict[str, Any]:
        if model not in names:
            raise OpenAIError(404, f"The model `{model[:64]}` does not exist", "model", "model_not_found")
        return {"id": name, "object": "model", "created": created, "owned_by": "layerswarm"}

    @app.post("/v1/completions", tags=["openai"], responses={400: {}, 404: {}, 429: {}, 503: {}})
    async def completions(request: Request) -> Response:
        """Complete a prompt (OpenAI's completions API; streaming as server-sent events)."""
        params: CompletionBody = await body_of(request, CompletionBody)
        prompt = _prompt_ids(params.prompt, generator.encode)
        opts = params.options(params.max_tokens)
        return await _serve(service, request, params, prompt, opts, _CompletionShape(name))

    @app.post("/v1/chat/completions", tags=["openai"], responses={400: {}, 404: {}, 429: {}, 503: {}})
    async def chat_completions(request: Request) -> Response:
        """Answer a conversation (OpenAI's chat completions API, through the chat template)."""
        params: ChatBody = await body_of(request, ChatBody)
        try:
            prompt = generator.encode(render(params.messages))
        except MAPPED as exc:
            raise as_openai_error(exc) from exc
        opts = params.options(params.max_completion_tokens or params.max_tokens, CHAT_STOPS)
        return await _serve(service, request, params, prompt, opts, _ChatShape(name))


def _prompt_ids(prompt: str | list[str] | list[int] | list[list[int]], encode: Callable[[str], list[int]]) -> list[int]:
    """One prompt (this server answers one choice): a string, a list of one, token ids, or a list of one."""
    if isinstance(prompt, str):
        text = prompt
    elif prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    elif len(prompt) == 1:
        only = prompt[0]
        if isinstance(only, list):
            return list(only)
        text = str(only)
    else:
        raise OpenAIError(
            400,
            "prompt: one prompt per request (a batch of prompts is not supported)",
            "prompt",
            "unsupported_parameter",
        )
    if len(text) > MAX_PROMPT_CHARS:
        raise OpenAIError(400, f"prompt: at most {MAX_PROMPT_CHARS} characters", "prompt", "context_length_exceeded")
    return encode(text)


async def _serve(
    service: Service,
    request: Request,
    params: CommonParams,
    prompt: list[int],
    options: GenerationOptions,
    shape: _Shape,
) -> Response:
    try:
        run = await GenerationRun.start(service, prompt, options)
    except MAPPED as exc:
        raise as_openai_error(exc) from exc
    if params.stream:
        include_usage = params.stream_options is not None and params.stream_options.include_usage
        return event_stream(run, _events(run, shape, include_usage))
    try:
        collected = await run.collect(request)
    except ClientGone:
        return Response(status_code=499)
    except MAPPED as exc:
        raise as_openai_error(exc) from exc
    body = shape.whole(run.session, collected.text, collected.finish_reason)
    return JSONResponse({**body, "usage": usage(run.session), "layerswarm": extras(run.session)})


async def _events(run: GenerationRun, shape: _Shape, include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    session = run.session
    try:
        first = shape.opening(session)
        if first is not None:
            yield _data(first)
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for delta in deltas:
                if delta.text or delta.finish_reason is not None:
                    chunk = shape.chunk(session, delta.text, delta.finish_reason)
                    if delta.finish_reason is not None:
                        chunk["layerswarm"] = extras(session)
                    yield _data(chunk)
        if include_usage:
            yield _data({**shape.chunk(session, None, None), "choices": [], "usage": usage(session)})
    except MAPPED as exc:
        yield _data(error_event(exc))
        return
    yield ServerSentEvent("[DONE]")


def _data(payload: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(payload, separators=(",", ":")))


def extras(session: StreamSession) -> dict[str, Any]:
    """layerswarm's own account of the answer: the seed (send it back for the same text), the route,
    tokens per second, and what happened to the route on the way (the trace)."""
    view = session.view()
    return {
        "seed": session.options.seed,
        "route": view["route"],
        "tokens_per_s": view["tokens_per_s"],
        "rebuilt": view["rebuilt"],
        "skipped": view["skipped"],
        "speculation": view["speculation"],
        "early_exit": view["early_exit"],
        "trips": view["trips"],
        "trace": session.trace,
    }


class _Shape:
    """How one endpoint's answers and chunks look."""

    def __init__(self, model: str) -> None:
        self.model = model

    def head(self, session: StreamSession, kind: str) -> dict[str, Any]:
        return {
            "id": f"{self.prefix}-{session.request_id}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
        }

    prefix = ""

    def opening(self, session: StreamSession) -> dict[str, Any] | None:
        return None

    def chunk(self, session: StreamSession, text: str | None, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, session: StreamSession, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionShape(_Shape):
    prefix = "cmpl"

    def chunk(self, session: StreamSession, text: str | None, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.head(session, "text_completion"), "choices": [choice]}

    def whole(self, session: StreamSession, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head(session, "text_completion"), "choices": [choice]}


class _ChatShape(_Shape):
    prefix = "chatcmpl"

    def opening(self, session: StreamSession) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self.head(session, "chat.completion.chunk"), "choices": [choice]}

    def chunk(self, session: StreamSession, text: str | None, finish: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self.head(session, "chat.completion.chunk"), "choices": [choice]}

    def whole(self, session: StreamSession, text: str, finish: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {**self.head(session, "chat.completion"), "choices": [choice]}
