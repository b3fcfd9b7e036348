"""What the sync and async clients share: request bodies, error parsing, and the retry policy."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypedDict, TypeVar

import httpx
from tenacity import RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from .results import SwarmError

ImageInput = str | os.PathLike[str] | bytes  # a file path, or the encoded image itself
HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)


DEFAULT_URL = "http://127.0.0.1:8080"


class ClientBase(Generic[HttpT]):
    """The connection, the coordinators to fail over between and the retry policy both clients are built
    from; each subclass names its httpx class."""

    http_class: type[HttpT]

    def __init__(
        self,
        base_url: str | Sequence[str] = DEFAULT_URL,
        *,
        timeout: float = 30.0,
        attempts: int = 4,
        max_backoff_s: float = 2.0,
        http: HttpT | None = None,
        api_key: str | None = None,
    ) -> None:
        """`base_url`: one coordinator, or several that serve the same swarm: a call that cannot reach one,
        or gets 429 or 503 from it, goes to the next at once (backing off only once every one was tried).
        `api_key`: one of the coordinators' keys (--api-key-file), sent on every call as
        `Authorization: Bearer KEY`, also on a given `http` client."""
        urls = (base_url,) if isinstance(base_url, str) else tuple(base_url)
        if not urls:
            raise ValueError("base_url: give at least one coordinator URL")
        if http is not None and base_url == DEFAULT_URL and str(http.base_url):
            urls = (str(http.base_url),)
        self._http: HttpT = http or self.http_class(base_url=urls[0], timeout=timeout)
        self._http.base_url = urls[0]
        if api_key is not None:
            if not api_key.strip() or api_key != api_key.strip():
                raise ValueError("api_key is empty or has spaces around it")
            self._http.headers["Authorization"] = f"Bearer {api_key}"
        self.failover = Failover(urls)
        # Classification and reads are idempotent: one that may have reached a coordinator that then died
        # is sent again, to another. A generation is not resent once sent (it could have been answered).
        self._retry = retry_policy(attempts, max_backoff_s, self.failover, idempotent=True)
        self._retry_unsent = retry_policy(attempts, max_backoff_s, self.failover, idempotent=False)

    @property
    def base_url(self) -> str:
        """The coordinator calls go to now: the last one that answered."""
        return self.failover.current

    def _aim(self) -> None:
        """Point the connection at the coordinator this attempt goes to."""
        if str(self._http.base_url) != self.failover.current:
            self._http.base_url = self.failover.current


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


# Never reached a coordinator whole: no connection, or it broke while the request was still being written
# (a coordinator killed mid-upload), so no coordinator can have acted on it.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.WriteTimeout)
SENT_MAYBE_ANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout)


def is_retryable(exc: BaseException, idempotent: bool = True) -> bool:
    """Retry what a later try can fix: no connection (yet) or a request cut off while being written, busy
    (429), too few blocks right now (503).
    A 4xx about the request itself would fail the same way again. A request whose connection broke after
    it was sent may have been answered: sent again only where doing it twice changes nothing."""
    if isinstance(exc, SwarmError):
        return exc.retryable
    if isinstance(exc, NOT_SENT):
        return True
    return idempotent and isinstance(exc, SENT_MAYBE_ANSWERED)


@dataclass
class Failover:
    """The coordinators a client knows, in order, and which it is on. Moving on is free until each has
    been tried once in this round; after that, the policy backs off before starting again."""

    urls: tuple[str, ...]
    index: int = 0
    tried_in_round: int = 1  # coordinators tried in this round, the current one included

    @property
    def current(self) -> str:
        return self.urls[self.index]

    def start_call(self) -> None:
        """A new call starts a round at the coordinator that answered last."""
        self.tried_in_round = 1

    def advance(self) -> None:
        """After a failed attempt: the next coordinator (the same one where there is only one)."""
        self.index = (self.index + 1) % len(self.urls)
        self.tried_in_round = self.tried_in_round % len(self.urls) + 1

    def mid_round(self) -> bool:
        """Whether the coordinator about to be tried has not been tried yet in this round."""
        return self.tried_in_round > 1


def retry_policy(attempts: int, max_backoff_s: float, failover: Failover, idempotent: bool) -> dict[str, Any]:
    """tenacity arguments: the next coordinator at once while any is untried this round, then exponential
    backoff with full jitter; the last error re-raised as is. `attempts` counts per coordinator."""
    backoff = wait_random_exponential(multiplier=0.05, max=max_backoff_s)  # "full jitter"

    def wait(state: RetryCallState) -> float:
        return 0.0 if failover.mid_round() else backoff(state)

    def next_coordinator(state: RetryCallState) -> None:
        failover.advance()

    return {
        "retry": retry_if_exception(lambda exc: is_retryable(exc, idempotent)),
        "stop": stop_after_attempt(max(1, attempts) * len(failover.urls)),
        "wait": wait,
        "reraise": True,
        "after": next_coordinator,
    }
