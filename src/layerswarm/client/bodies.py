"""What the sync and async clients share: request bodies, error parsing, and the retry policy."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypedDict, TypeVar

import httpx
from tenacity import retry_if_exception, stop_after_attempt, wait_random_exponential

from .results import SwarmError

ImageInput = str | os.PathLike[str] | bytes  # a file path, or the encoded image itself
HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)


class ClientBase(Generic[HttpT]):
    """The connection and retry policy both clients are built from; each subclass names its httpx class."""

    http_class: type[HttpT]

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        timeout: float = 30.0,
        attempts: int = 4,
        max_backoff_s: float = 2.0,
        http: HttpT | None = None,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: one of the coordinator's keys (--api-key-file), sent on every call as
        `Authorization: Bearer KEY`, also on a given `http` client."""
        self._http: HttpT = http or self.http_class(base_url=base_url, timeout=timeout)
        if api_key is not None:
            if not api_key.strip() or api_key != api_key.strip():
                raise ValueError("api_key is empty or has spaces around it")
            self._http.headers["Authorization"] = f"Bearer {api_key}"
        self._retry = retry_policy(attempts, max_backoff_s)


class Options(TypedDict, total=False):
    """Per-request options, as the coordinator's API names them (coordinator/http_models.ClassifyParams;
    tests/client/test_client.py checks that the two list the same options with the same types). `label` is
    the calls' own argument."""

    top_k: int
    policy: Literal["sequential", "shuffle", "fastest"]
    seed: int
    min_blocks: int
    max_blocks: int
    exit_confidence: float
    exit_rule: Literal["confidence", "entropy", "patience", "none"]
    exit_threshold: float
    deadline_ms: float  # anytime: answer with what ran once the next hop would miss this budget
    ensemble: int  # routes whose logits are averaged
    ensemble_mode: Literal["adaptive", "parallel"]
    ensemble_confidence: float
    ensemble_over: Literal["members", "orders"]
    repeats: bool  # run reachable blocks again when too few indices are reachable
    resize: bool


def image_bytes(image: ImageInput) -> bytes:
    return image if isinstance(image, bytes) else Path(image).read_bytes()


def form_fields(options: Options) -> dict[str, str]:
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items() if v is not None}


def single_body(image: ImageInput, label: str | None, options: Options) -> dict[str, Any]:
    data = form_fields(options) | ({"label": label} if label is not None else {})
    return {"files": {"file": ("image", image_bytes(image))}, "data": data}


def batch_body(images: Sequence[ImageInput], labels: Sequence[str] | None, options: Options) -> dict[str, Any]:
    if labels is not None and len(labels) != len(images):
        raise ValueError(f"{len(labels)} labels for {len(images)} images")
    files = [("file", (f"image-{i}", image_bytes(image))) for i, image in enumerate(images)]
    data: dict[str, Any] = form_fields(options)
    if labels is not None:
        data["label"] = list(labels)
    return {"files": files, "data": data}


def checked(response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 2xx reply; a SwarmError with the coordinator's reason otherwise."""
    if response.status_code < 400:
        body: dict[str, Any] = response.json()
        return body
    try:
        error = response.json()
        code, detail = str(error.get("error", "http_error")), error.get("detail", response.text)
    except ValueError:
        code, detail = "http_error", response.text
    raise SwarmError(response.status_code, code, detail)


def is_retryable(exc: BaseException) -> bool:
    """Retry what a later try can fix: no connection (yet), busy (429), too few blocks right now (503).
    A 4xx about the request itself would fail the same way again."""
    if isinstance(exc, SwarmError):
        return exc.retryable
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.RemoteProtocolError)


def retry_policy(attempts: int, max_backoff_s: float) -> dict[str, Any]:
    """tenacity arguments: exponential backoff with full jitter, the last error re-raised as is."""
    return {
        "retry": retry_if_exception(is_retryable),
        "stop": stop_after_attempt(max(1, attempts)),
        "wait": wait_random_exponential(multiplier=0.05, max=max_backoff_s),  # "full jitter"
        "reraise": True,
    }
