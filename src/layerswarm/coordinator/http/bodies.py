"""Request bodies parsed defensively: JSON objects and multipart forms, in memory, bounded.

JSON: a body that is not a JSON object of plain values (too deep, numbers too long, NaN, not
UTF-8, an array...) is a 400 with the reason, never a 500. Multipart: Starlette's parser, fed the
size-limited stream and told never to spool a file part to disk (the whole body is capped at the
upload limit, so it stays in memory: nothing on disk, and nothing past the limit read at all).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from .admission import Gate, stream_limited
from .errors import ApiError

MAX_INT_DIGITS = 20  # no option needs more; int() of 4,301+ digits raises, and long ones cost quadratic time
MAX_FORM_FIELDS = 16
MAX_FIELD_BYTES = 1024


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


async def read_json_object(gate: Gate, request: Request, limit: int) -> dict[str, Any]:
    return parse_json_object(await gate.read_body(request, limit))


async def read_form(gate: Gate, request: Request, limit: int) -> tuple[dict[str, bytes], dict[str, str]]:
    """A multipart form: (files by field name, text fields), at most one file, all in memory."""
    files, fields = await read_form_items(gate, request, limit, max_files=1, max_fields=MAX_FORM_FIELDS)
    return dict(files), dict(fields)


async def read_form_items(
    gate: Gate, request: Request, limit: int, max_files: int, max_fields: int
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
        async with gate.body_slot():
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
