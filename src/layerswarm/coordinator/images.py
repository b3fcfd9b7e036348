"""Encoded images (PNG, JPEG, ...) to the model's input tensor, with bounds checked before decoding.

Shared by the native API and the Open Inference Protocol; each turns `ImageError` into its own
error format. Never raises anything else for bad bytes.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from layerswarm.models.images import decode_image

MAX_PIXELS = 4096 * 4096  # refuse decompression bombs before decoding


class ImageError(ValueError):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


def decode_one(image: bytes, size: int, resize: bool) -> np.ndarray:
    """float32 (3, size, size) in [0, 1]."""
    if not image:
        raise ImageError(400, "empty_image", "the image is empty")
    try:
        with Image.open(io.BytesIO(image)) as probe:
            width, height = probe.size
        if width * height > MAX_PIXELS:
            raise ImageError(413, "too_large", f"image of {width}x{height} pixels is too large")
        if (width, height) != (size, size) and not resize:
            raise ImageError(
                422, "wrong_size", f"image is {width}x{height}, the model takes {size}x{size} (or pass resize=true)"
            )
        return decode_image(image, size if resize else None)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(400, "invalid_image", f"cannot decode the image: {exc}") from exc


def decode_batch(images: Sequence[bytes], size: int, resize: bool) -> torch.Tensor:
    """(B, 3, size, size); the error names the item that failed when there are several."""
    arrays = []
    for index, image in enumerate(images):
        try:
            arrays.append(decode_one(image, size, resize))
        except ImageError as exc:
            if len(images) == 1:
                raise
            raise ImageError(exc.status, exc.error, f"item {index}: {exc.detail}") from exc
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))
