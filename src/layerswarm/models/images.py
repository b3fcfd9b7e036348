"""Images in and out of the model's size: one decode-and-resize policy for every path.

The policy (training folders, eval, HTTP `resize=true`, samples) is the one of Hugging Face's
ViTImageProcessor, so an imported checkpoint sees the pixels it was trained on:

- decode with Pillow, convert to RGB (palette, grey and alpha images included; alpha is dropped;
  16-bit grey scaled to 8 bits, see to_rgb);
- resize the whole image to image_size x image_size with bilinear filtering: no crop, the aspect
  ratio is not kept (a 4:3 photo is squeezed, never cut);
- scale to float32 in [0, 1], channels first (3, H, W).

Normalisation ((x - mean) / std) is not done here: it is the stem's job, with the mean and std
saved in the model's config (an imported checkpoint takes them from its preprocessor_config.json).
Torchvision is not used: Pillow and numpy are enough and install everywhere.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

RESAMPLE = Image.Resampling.BILINEAR  # HF ViTImageProcessor's default (resample=2)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm"})
# The modes Pillow opens 16-bit greyscale in (PNG and TIFF: "I;16"; PGM: "I", 32-bit integers holding
# 0..65535). Its convert("RGB") clips every sample above 255 instead of scaling, so a 16-bit scan or
# depth map came out as a white square: in training and at the coordinator alike, with no error.
SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
SIXTEEN_TO_EIGHT = 257.0  # 65535 / 255: full scale to full scale


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB: what every path feeds the model. 16-bit grey is scaled to 8 bits (samples above 65535
    in a 32-bit "I" image clip to white), every other mode is Pillow's own conversion."""
    if img.mode in SIXTEEN_BIT_GREY:
        samples = np.asarray(img, dtype=np.float64)  # any byte order
        grey = np.clip(np.round(samples / SIXTEEN_TO_EIGHT), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return img.convert("RGB")


def resize_to_model(img: Image.Image, image_size: int) -> Image.Image:
    """The one resize policy: the whole image, squeezed to a square of the model's side."""
    rgb = to_rgb(img)
    if rgb.size != (image_size, image_size):
        rgb = rgb.resize((image_size, image_size), RESAMPLE)
    return rgb


def decode_image(data: bytes | Path, image_size: int | None = None) -> np.ndarray:
    """Decode to float32 (3, H, W) in [0, 1]; resized to image_size when one is given."""
    with Image.open(data if isinstance(data, Path) else io.BytesIO(data)) as img:
        rgb = resize_to_model(img, image_size) if image_size is not None else to_rgb(img)
        return np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0


def png_bytes(image: np.ndarray) -> bytes:
    """(3, H, W) float in [0, 1] -> PNG bytes (samples, load generators)."""
    pixels = (np.clip(image, 0.0, 1.0).transpose(1, 2, 0) * 255).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
