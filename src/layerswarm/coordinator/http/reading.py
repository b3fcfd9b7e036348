"""Reading a classify request: the content type, the image(s) and the options. Every body goes through
the front door's strict readers (streamed under its limit, in a bounded body slot, strict JSON, no
multipart part spooled to disk), single images and batches alike."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .bodies import BodySlots, read_form, read_form_items, read_json_object
from .errors import ApiError, describe
from .schemas import MAX_LABEL_CHARS, BatchJson, ClassifyJson, ClassifyParams

JSON, MULTIPART = "application/json", "multipart/form-data"
FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries, part headers and option fields around the image
BATCH_FORM_FIELDS = 16  # options beside the files (plus one `label` per file)

Batch = tuple[list[bytes], list[str | None], ClassifyParams]  # images, their true labels if given, options


def content_type_of(request: Request, what: str, accept: tuple[str, ...] = (JSON, MULTIPART)) -> str:
    """One of `accept`, else 415 naming what to send (`what`: the JSON field with the input)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in accept:
        forms = "multipart/form-data with `file` part(s), or " if MULTIPART in accept else ""
        raise ApiError(415, "unsupported_media_type", f"send {forms}application/json with `{what}`")
    return content_type


@contextmanager
def upload_limit_explained(limit: int) -> Iterator[None]:
    """A 413 on the whole body says which setting it comes from (the body may hold the form around the
    image(s) beyond the images' own limit, so its number alone puzzled users)."""
    try:
        yield
    except ApiError as exc:
        if exc.status_code != 413:
            raise
        raise ApiError(
            413, exc.error, f"{exc.detail}: images are limited to {limit} bytes each (--max-upload-bytes)"
        ) from exc


M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], data: object) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", describe(exc.errors())) from exc


def _base64(text: str, where: str, limit: int) -> bytes:
    try:
        image = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, "invalid_base64", f"{where} is not valid base64: {exc}") from exc
    if len(image) > limit:
        raise ApiError(413, "too_large", f"{where}: image over the {limit}-byte upload limit")
    return image


def _options(fields: dict[str, str]) -> ClassifyParams:
    return _validated(ClassifyParams, {k: v for k, v in fields.items() if v != ""})


async def read_classify(slots: BodySlots, request: Request, limit: int) -> tuple[bytes, ClassifyParams]:
    """One image and its options (multipart `file`, or JSON `image_base64`)."""
    if content_type_of(request, "image_base64") == JSON:
        with upload_limit_explained(limit):
            data = await read_json_object(slots, request, limit * 4 // 3 + FORM_OVERHEAD_BYTES)
        params = _validated(ClassifyJson, data)
        image = _base64(params.image_base64, "image_base64", limit)
        return image, ClassifyParams.model_validate(params.model_dump(exclude={"image_base64"}))
    with upload_limit_explained(limit):
        files, fields = await read_form(slots, request, limit + FORM_OVERHEAD_BYTES)
    if not files and not fields:  # e.g. a body cut short before its first part ended
        raise ApiError(400, "invalid_multipart", "no complete part in the multipart body (was it cut short?)")
    if set(files) != {"file"}:
        raise ApiError(422, "invalid_request", "multipart body needs one file part, named `file`, with the image")
    if len(files["file"]) > limit:
        raise ApiError(413, "too_large", f"image over the {limit}-byte upload limit")
    return files["file"], _options(fields)


async def read_batch(slots: BodySlots, request: Request, limit: int, max_batch: int) -> Batch:
    """The images of a batch (each at most `limit` bytes, at most `max_batch`), their labels, options."""
    body_limit = limit * 4 + FORM_OVERHEAD_BYTES  # the whole batch: four uploads' worth
    if content_type_of(request, "images") == JSON:
        with upload_limit_explained(limit):
            body = await read_json_object(slots, request, body_limit * 4 // 3)
        batch = _validated(BatchJson, body)
        _check_batch(len(batch.images), max_batch, batch.label)
        images = [_base64(item.image_base64, f"images.{i}.image_base64", limit) for i, item in enumerate(batch.images)]
        return (
            images,
            [item.label for item in batch.images],
            ClassifyParams.model_validate(batch.model_dump(exclude={"images"})),
        )
    with upload_limit_explained(limit):
        files, fields = await read_form_items(
            slots, request, body_limit, max_files=max_batch + 1, max_fields=BATCH_FORM_FIELDS + max_batch
        )
    if not files and not fields:
        raise ApiError(400, "invalid_multipart", "no complete part in the multipart body (was it cut short?)")
    if not files or any(name != "file" for name, _ in files):
        raise ApiError(422, "invalid_request", "multipart body needs one or more `file` parts with the images")
    _check_batch(len(files), max_batch, None)
    labels = [value for name, value in fields if name == "label"]
    if labels and len(labels) != len(files):
        raise ApiError(422, "invalid_request", f"{len(labels)} `label` fields for {len(files)} files")
    if any(len(label) > MAX_LABEL_CHARS for label in labels):
        raise ApiError(422, "invalid_request", f"a `label` field is longer than {MAX_LABEL_CHARS} characters")
    if any(len(image) > limit for _, image in files):
        raise ApiError(413, "too_large", f"an image is over the {limit}-byte upload limit")
    params = _options({name: value for name, value in fields if name != "label"})
    return [image for _, image in files], [v or None for v in labels] or [None] * len(files), params


def _check_batch(size: int, max_batch: int, top_level_label: str | None) -> None:
    if size > max_batch:
        raise ApiError(413, "batch_too_large", f"{size} images in one batch, at most {max_batch}")
    if top_level_label is not None:
        raise ApiError(422, "invalid_request", "in a batch, give each image its own `label`")
