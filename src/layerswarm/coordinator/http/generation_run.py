"""One generation as every API runs it (native /v1/generate, OpenAI's completions and chat).

    start    admitted (admission.py: one count with classification), the stream opened and its prompt
             prefilled BEFORE any answer starts: a bad request, a thin swarm or a failed prefill is an
             HTTP error, never a stream that breaks at its first byte
    deltas   then its tokens, as the generator gives them
    finish   the stream closed (its caches released on every node) and its place given back, however
             it ended: finished, failed, or the client went away (a cancelled response closes it too,
             from the generator's finally)

Non-streamed answers (`collect`) look for a client that went away between tokens, so a closed
connection frees the nodes without waiting for max_tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import torch
from fastapi import Request

from ..generation.generator import Generator
from ..generation.options import GenerationOptions
from ..generation.runner import StreamFailed
from ..generation.session import Delta, StreamSession
from .service import Service

DISCONNECT_CHECK_EVERY = 4  # tokens between looks at the connection in a non-streamed answer


class ClientGone(Exception):
    """A non-streamed answer's client closed its connection: nothing left to answer."""


@dataclass
class Collected:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class GenerationRun:
    def __init__(
        self, generator: Generator, session: StreamSession, logits: torch.Tensor, lease: contextlib.AsyncExitStack
    ) -> None:
        self.generator = generator
        self.session = session
        self._logits = logits
        self._lease = lease
        self._finished = False

    @classmethod
    async def start(cls, service: Service, prompt: Sequence[int], options: GenerationOptions) -> GenerationRun:
        """Raises InvalidGeneration, DepthError, StreamFailed, and the admission's ApiError (429)."""
        generator = service.generator
        lease = contextlib.AsyncExitStack()
        await lease.enter_async_context(service.admission.admit())
        try:
            session = await generator.open(prompt, options)
        except BaseException:
            await lease.aclose()
            raise
        try:
            logits = await generator.prefill(session)
        except BaseException as exc:
            generator.close(session, f"prefill: {exc}" if isinstance(exc, StreamFailed) else None)
            await lease.aclose()
            raise
        return cls(generator, session, logits, lease)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The stream's tokens; closed at the end whatever ends it. Raises StreamFailed."""
        error: str | None = None
        try:
            async for delta in self.generator.tokens(self.session, self._logits):
                yield delta
        except StreamFailed as exc:
            error = str(exc)
            raise
        finally:
            await self.finish(error)

    async def collect(self, request: Request) -> Collected:
        """The whole answer (non-streamed). Raises StreamFailed, and ClientGone when the client left."""
        out = Collected("")
        async with contextlib.aclosing(self.deltas()) as deltas:  # closed here, even when we stop early
            async for delta in deltas:
                out.text += delta.text
                if delta.token is not None:
                    out.token_ids.append(delta.token)
                out.finish_reason = delta.finish_reason
                if len(out.token_ids) % DISCONNECT_CHECK_EVERY == 0 and await request.is_disconnected():
                    raise ClientGone()
        return out

    async def finish(self, error: str | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        self.generator.close(self.session, error)  # releases in a task of its own
        await self._lease.aclose()
