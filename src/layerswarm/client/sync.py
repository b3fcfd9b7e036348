"""The blocking client."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from httpx_sse import EventSource
from tenacity import Retrying
from typing_extensions import Unpack

from .bodies import ClientBase, ImageInput, Options, batch_body, checked, single_body
from .generation import GenerateOptions, Generation, StreamEvent, generate_body, parse_event
from .results import BatchClassification, Classification, SwarmView


class SwarmClient(ClientBase[httpx.Client]):
    """A coordinator's native API. Retries connect errors, 429 and 503 with backoff (tenacity).

    >>> with SwarmClient("http://127.0.0.1:8080") as swarm:
    ...     print(swarm.classify("image.png", top_k=3).prediction)
    """

    http_class = httpx.Client

    def classify(self, image: ImageInput, *, label: str | None = None, **options: Unpack[Options]) -> Classification:
        """One image (a path or its bytes); `label`, if you know the true class, counts in the page's accuracy."""
        return Classification.from_json(self._post("/v1/classify", single_body(image, label, options)))

    def classify_batch(
        self, images: Sequence[ImageInput], *, labels: Sequence[str] | None = None, **options: Unpack[Options]
    ) -> BatchClassification:
        """Several images as one batch: one path through the swarm, one answer per image."""
        return BatchClassification.from_json(self._post("/v1/classify/batch", batch_body(images, labels, options)))

    def generate(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> Generation:
        """Text (or token ids) continued through a decoder family's swarm; the whole answer at once."""
        body = generate_body(prompt, options, stream=False)
        return Generation.from_json(self._call("POST", "/v1/generate", body, idempotent=False))

    def generate_stream(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> Iterator[StreamEvent]:
        """The same, token by token: TokenEvents as tokens are drawn, then the whole Generation. Opening
        the stream is retried as any call is; a stream that breaks later raises SwarmError. Leaving the
        loop early closes the connection, and the coordinator frees the nodes' caches."""
        response = self._open_stream(generate_body(prompt, options, stream=True))
        try:
            for event in EventSource(response).iter_sse():
                yield parse_event(event)
        finally:
            response.close()

    def _open_stream(self, body: dict[str, Any]) -> httpx.Response:
        retry = self._retry_unsent  # a stream once sent is not sent again: it may have been answered
        self.failover.start_call()
        for attempt in Retrying(**retry):
            with attempt:
                self._aim()
                response = self._http.send(self._http.build_request("POST", "/v1/generate", **body), stream=True)
                if response.status_code >= 400:
                    response.read()
                    response.close()
                    checked(response)  # raises the coordinator's reason
                return response
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def swarm(self) -> SwarmView:
        return SwarmView.from_json(self._call("GET", "/v1/nodes", {}))

    def ready(self) -> bool:
        """Whether the coordinator can answer now (no retries: a probe)."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: dict[str, Any], idempotent: bool = True) -> dict[str, Any]:
        retry = self._retry if idempotent else self._retry_unsent
        self.failover.start_call()
        for attempt in Retrying(**retry):
            with attempt:
                self._aim()
                return checked(self._http.request(method, path, **body))
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
