"""Image decoding off the event loop, with a pixel budget checked from the header before decoding.

A PNG of 81 KB can declare 1 x 16,777,216 pixels; decoding it (and resizing it) on the event loop
stalled every other request for seconds. Here the header is read first (in a worker: even header
parsing can inflate compressed text chunks) and an image over the pixel budget is refused with 413
before any pixel is decoded, resize or not. Decoding runs in two bounded lanes: images no larger
than SMALL_IMAGE_PIXELS in one, larger ones in the other, with at most MAX_LARGE_WAITING queued, so
clients sending big images slow down only each other, never the event loop or ordinary requests.
Only common raster formats are opened (no EPS, which would run Ghostscript).
"""

from __future__ import annotations

import asyncio
import io
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from prometheus_client import Gauge

from layerswarm.models.images import to_rgb

from .errors import ApiError

# PPM (.ppm, .pgm): image folders of them train (models/images.py IMAGE_SUFFIXES), so the model serves them.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
# What Pillow raises on corrupt pixel data: OSError and ValueError mostly, but its plugins also let out
# SyntaxError (a PNG chunk of an impossible type, an APNG frame out of sequence), TypeError and
# OverflowError (a TIFF strip offset that is a float, or past 2**63), found by mutating valid images.
# Each is the image's fault (400), never a bug of ours (500).
CORRUPT_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, TypeError, OverflowError, EOFError, IndexError, struct.error)
SMALL_IMAGE_PIXELS = 512 * 512  # decodes in about a millisecond
MAX_LARGE_WAITING = 4  # large images queued or decoding; past this: 429


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


class Decoder:
    def __init__(self, image_size: int, max_pixels: int, decoding: Gauge) -> None:
        self.image_size = image_size
        self.max_pixels = max_pixels
        self._decoding = decoding  # by lane: a scrape during a decode shows it (the loop is free meanwhile)
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-small")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-large")
        self._large_waiting = 0

    async def to_batch(self, data: bytes, resize: bool) -> torch.Tensor:
        """(1, 3, S, S) float32 in [0, 1]; ApiError 400/413/422/429 with the reason otherwise."""
        if not data:
            raise ApiError(400, "empty_image", "the image is empty")
        loop = asyncio.get_running_loop()
        header = await loop.run_in_executor(self._small, read_header, data)
        size = self.image_size
        if header.pixels > self.max_pixels:
            raise ApiError(
                413,
                "too_many_pixels",
                f"image of {header.width}x{header.height} = {header.pixels} pixels is over the budget of "
                f"{self.max_pixels} pixels",
            )
        if (header.width, header.height) != (size, size) and not resize:
            raise ApiError(
                422,
                "wrong_size",
                f"image is {header.width}x{header.height}, the model takes {size}x{size} (or pass resize=true)",
            )
        if header.pixels <= SMALL_IMAGE_PIXELS:
            array = await self._decode(self._small, "small", data)
        else:
            if self._large_waiting >= MAX_LARGE_WAITING:
                raise ApiError(429, "busy", f"{self._large_waiting} large images are being decoded; retry")
            self._large_waiting += 1
            try:
                array = await self._decode(self._large, "large", data)
            finally:
                self._large_waiting -= 1
        return torch.from_numpy(np.ascontiguousarray(array))[None]

    async def decode_many(self, images: list[bytes], resize: bool) -> torch.Tensor:
        """(B, 3, S, S), one image at a time through to_batch; an error names the item that failed."""
        batch = []
        for index, data in enumerate(images):
            try:
                batch.append(await self.to_batch(data, resize))
            except ApiError as exc:
                if len(images) == 1:
                    raise
                raise ApiError(exc.status_code, exc.error, f"item {index}: {exc.detail}") from exc
        return torch.cat(batch)

    async def _decode(self, lane: ThreadPoolExecutor, name: str, data: bytes) -> np.ndarray:
        gauge = self._decoding.labels(name)
        gauge.inc()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(lane, decode, data, self.image_size, self.max_pixels)
        finally:
            gauge.dec()

    def close(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


def read_header(data: bytes) -> ImageHeader:
    """Width and height from the header alone (no pixel decoded)."""
    with _open(data) as image:
        return ImageHeader(*image.size)


def decode(data: bytes, size: int, max_pixels: int) -> np.ndarray:
    """Decode to float32 (3, size, size) in [0, 1], resizing when the image has another size."""
    with _open(data) as image:
        if image.size[0] * image.size[1] > max_pixels:  # checked before; a second look costs nothing
            raise ApiError(413, "too_many_pixels", f"image of {image.size} pixels is over the budget")
        try:
            rgb = to_rgb(image)  # training's conversion: 16-bit grey scaled, not clipped to white
        except CORRUPT_IMAGE_ERRORS as exc:  # truncated or corrupt pixel data
            raise ApiError(400, "invalid_image", f"cannot decode the image: {exc}") from exc
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        raise ApiError(413, "too_many_pixels", f"decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:  # its message names our in-memory buffer, nothing of use
        raise ApiError(400, "invalid_image", f"not an image in a format read here ({', '.join(FORMATS)})") from exc
    except CORRUPT_IMAGE_ERRORS as exc:
        raise ApiError(400, "invalid_image", f"cannot decode the image: {exc}") from exc
