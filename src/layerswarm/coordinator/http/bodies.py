"""Request bodies read under bounds and parsed defensively: JSON objects and multipart forms, in memory.

Reading: an admitted request (admission.py) waits for one of a few body-read slots, then its body is
read chunk by chunk and refused with 413 the moment it passes the limit (Content-Length and chunked
alike). So held or oversized bodies cost at most `max_body_reads` x the limit in memory, and nothing
is buffered for a request that is refused anyway.

JSON: a body that is not a JSON object of plain values (too deep, numbers too long, NaN, not
UTF-8, an array...) is a 400 with the reason, never a 500. Multipart: Starlette's parser, fed the
size-limited stream and told never to spool a file part to disk (the whole body is capped at the
upload limit, so it stays in memory: nothing on disk, and nothing past the limit read at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from prometheus_client import Gauge
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from .errors import ApiError

MAX_INT_DIGITS = 20  # no option needs more; int() of 4,301+ digits raises, and long ones cost quadratic time
MAX_FORM_FIELDS = 16
MAX_FIELD_BYTES = 1024
BODY_SLOT_WAIT_S = 1.0  # a legit body reads in milliseconds; waiting longer means slow clients hold every slot


class BodySlots:
    """At most `max_body_reads` request bodies read at once; a request that cannot get a slot within
    BODY_SLOT_WAIT_S is answered 429."""

    def __init__(self, max_body_reads: int, reading: Gauge) -> None:
        self.max_body_reads = max_body_reads
        self._slots = asyncio.Semaphore(max_body_reads)
        self._reading = reading

    async def read_body(self, request: Request, limit: int) -> bytes:
        """The whole body, read in a body slot, 413 as soon as it passes `limit` bytes."""
        chunks = []
        async with self.slot():
            async for chunk in stream_limited(request, limit):
                chunks.append(chunk)
        return b"".join(chunks)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self._slots.acquire(), BODY_SLOT_WAIT_S)
        except asyncio.TimeoutError as exc:
            raise ApiError(429, "busy", f"{self.max_body_reads} request bodies are being read; retry") from exc
        self._reading.inc()
        try:
            yield
        finally:
            self._slots.release()
            self._reading.dec()


async def stream_limited(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body's chunks; ApiError 413 from the declared length, or while streaming once past `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, "too_large", f"request body of {declared} bytes is over the {limit}-byte limit")
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", f"request body over the {limit}-byte limit")
        yield chunk


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; ApiError 400 `invalid_json` with the reason otherwise."""
    try:
        data = json.loads(body, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError as exc:
        raise ApiError(400, "invalid_json", "JSON nested too deeply") from exc
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_json", f"body is not UTF-8 JSON: {exc.reason} at byte {exc.start}") from exc
    except ValueError as exc:  # JSONDecodeError and the hooks' refusals
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", f"body must be a JSON object, not {type(data).__name__}")
    return data


def plain_int(text: str) -> int | None:
    """`text` as an int when it is at most MAX_INT_DIGITS ASCII digits, else None: "²" is a digit to
    str.isdigit but int() raises on it, as it does on 4,301 digits or more."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= MAX_INT_DIGITS else None


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


async def read_json_object(slots: BodySlots, request: Request, limit: int) -> dict[str, Any]:
    return parse_json_object(await slots.read_body(request, limit))


async def read_form(slots: BodySlots, request: Request, limit: int) -> tuple[dict[str, bytes], dict[str, str]]:
    """A multipart form: (files by field name, text fields), at most one file, all in memory."""
    files, fields = await read_form_items(slots, request, limit, max_files=1, max_fields=MAX_FORM_FIELDS)
    return dict(files), dict(fields)


async def read_form_items(
    slots: BodySlots, request: Request, limit: int, max_files: int, max_fields: int
) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
    """A multipart form as (file parts, text fields), each in order with its name, all in memory."""
    parser = MultiPartParser(
        request.headers,
        stream_limited(request, limit),
        max_files=max_files,
        max_fields=max_fields,
        max_part_size=MAX_FIELD_BYTES,
    )
    parser.spool_max_size = limit + 1  # never roll a file part over to disk (the body is capped at limit)
    try:
        async with slots.slot():
            form = await parser.parse()
    except MultiPartException as exc:
        raise ApiError(400, "invalid_multipart", exc.message) from exc
    files: list[tuple[str, bytes]] = []
    fields: list[tuple[str, str]] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                files.append((name, await value.read()))
            else:
                fields.append((name, value))
    finally:
        await form.close()
    return files, fields
