"""The asyncio client: the same calls as SwarmClient, awaited."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying
from typing_extensions import Unpack

from .bodies import ClientBase, ImageInput, Options, batch_body, checked, single_body
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

    async def swarm(self) -> SwarmView:
        return SwarmView.from_json(await self._call("GET", "/v1/nodes", {}))

    async def ready(self) -> bool:
        try:
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async for attempt in AsyncRetrying(**self._retry):
            with attempt:
                return checked(await self._http.request(method, path, **body))
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSwarmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
