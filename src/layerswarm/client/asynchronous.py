"""The asyncio client: the same calls as SwarmClient, awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource
from tenacity import AsyncRetrying
from typing_extensions import Unpack

from .bodies import ClientBase, ImageInput, Options, batch_body, checked, single_body
from .generation import GenerateOptions, Generation, StreamEvent, generate_body, parse_event
from .results import BatchClassification, Classification, SwarmView


class AsyncSwarmClient(ClientBase[httpx.AsyncClient]):
    """A coordinator's native API for asyncio code. Retries connect errors, 429 and 503 with backoff."""

    http_class = httpx.AsyncClient

    async def classify(
        self, image: ImageInput, *, label: str | None = None, **options: Unpack[Options]
    ) -> Classification:
        return Classification.from_json(await self._call("POST", "/v1/classify", single_body(image, label, options)))

    async def classify_batch(
        self, images: Sequence[ImageInput], *, labels: Sequence[str] | None = None, **options: Unpack[Options]
    ) -> BatchClassification:
        body = batch_body(images, labels, options)
        return BatchClassification.from_json(await self._call("POST", "/v1/classify/batch", body))

    async def generate(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> Generation:
        body = generate_body(prompt, options, stream=False)
        return Generation.from_json(await self._call("POST", "/v1/generate", body, idempotent=False))

    async def generate_stream(
        self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[StreamEvent]:
        """TokenEvents as tokens are drawn, then the whole Generation (as SwarmClient.generate_stream)."""
        response = await self._open_stream(generate_body(prompt, options, stream=True))
        try:
            async for event in EventSource(response).aiter_sse():
                yield parse_event(event)
        finally:
            await response.aclose()

    async def _open_stream(self, body: dict[str, Any]) -> httpx.Response:
        retry = self._retry_unsent  # a stream once sent is not sent again: it may have been answered
        self.failover.start_call()
        async for attempt in AsyncRetrying(**retry):
            with attempt:
                self._aim()
                request = self._http.build_request("POST", "/v1/generate", **body)
                response = await self._http.send(request, stream=True)
                if response.status_code >= 400:
                    await response.aread()
                    await response.aclose()
                    checked(response)
                return response
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def swarm(self) -> SwarmView:
        return SwarmView.from_json(await self._call("GET", "/v1/nodes", {}))

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def _call(self, method: str, path: str, body: dict[str, Any], idempotent: bool = True) -> dict[str, Any]:
        retry = self._retry if idempotent else self._retry_unsent
        self.failover.start_call()
        async for attempt in AsyncRetrying(**retry):
            with attempt:
                self._aim()
                return checked(await self._http.request(method, path, **body))
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSwarmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
