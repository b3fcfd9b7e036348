"""The wire's tensor format in numpy: numpy.ndarray <-> layerswarm.v1.Tensor, validated, without torch.

This is the one implementation of the format (what the bytes, shape and scales of a message must be);
`codec.py` is its torch face for the coordinator and the torch engine. A lean node (node/engines/,
no torch installed) decodes and encodes with this module alone.

Bytes are little-endian and C-contiguous; bfloat16 travels as its raw 16-bit pattern (numpy has no
bfloat16: decoded here to float32, which holds every bfloat16 exactly; encoded with round-to-nearest-even,
as torch casts). `int8` is row-scaled: symmetric int8 with one float32 scale per row of the last dimension,
decoded to float32. Decoding never trusts the sender: dtype, rank, shape, byte count, size limit, scales
and finiteness are all checked, and a violation raises TensorError with a message fit to send back as
INVALID_ARGUMENT or HTTP 4xx.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .v1 import block_pb2 as pb

FP32: int = pb.DTYPE_FLOAT32
FP16: int = pb.DTYPE_FLOAT16
BF16: int = pb.DTYPE_BFLOAT16
INT8: int = pb.DTYPE_INT8
NAMES: dict[int, str] = {FP32: "fp32", FP16: "fp16", BF16: "bf16", INT8: "int8"}
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
# What each wire dtype's elements are stored as (bf16: its raw 16-bit pattern).
_STORED: dict[int, np.dtype[np.generic]] = {
    FP32: np.dtype("<f4"),
    FP16: np.dtype("<f2"),
    BF16: np.dtype("<i2"),
    INT8: np.dtype("i1"),
}
_LIMITS: dict[int, float] = {
    FP32: float(np.finfo(np.float32).max),
    FP16: float(np.finfo(np.float16).max),
    BF16: 3.3895313892515355e38,
}

if sys.byteorder != "little":  # pragma: no cover - every platform we target is little-endian
    raise ImportError("layerswarm's wire codec assumes a little-endian host")


class TensorError(ValueError):
    """An incoming tensor is malformed, of the wrong shape or dtype, too large, or not finite."""


@dataclass(frozen=True)
class TensorSpec:
    """What a boundary accepts: rank and fixed dims (None = any, up to `max_batch` for dim 0)."""

    shape: tuple[int | None, ...]
    max_batch: int = 64
    max_bytes: int = DEFAULT_MAX_BYTES


def check_wire(code: int) -> int:
    """`code` when it names a wire dtype, else TensorError."""
    if code not in NAMES:
        raise TensorError(f"unsupported wire dtype {code}; expected fp32, fp16, bf16 or int8")
    return code


def name_of(code: int) -> str:
    """fp32, fp16, bf16 or int8."""
    return NAMES[check_wire(code)]


def value_limit(code: int) -> float:
    """The largest magnitude a wire dtype carries (row-scaled int8: whatever float32 scales carry)."""
    return _LIMITS.get(check_wire(code), _LIMITS[FP32])


def peak_abs(a: np.ndarray) -> float:
    """The largest |value| of a non-empty array: NaN or Inf when any value is (max and min propagate NaN)."""
    return max(-float(a.min()), float(a.max()))


def quantize_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scale per row of the last dim); a zero row gets scale 1. The same float32
    operations as codec.quantize_rows, so both give the same bytes."""
    if a.size == 0:
        return np.empty(a.shape, dtype=np.int8), np.empty(0, dtype=np.float32)
    rows = a.astype(np.float32, copy=False).reshape(-1, a.shape[-1] if a.ndim else 1)
    scales = np.abs(rows).max(axis=-1) / np.float32(127.0)
    scales = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(rows / scales[:, None]), -127, 127).astype(np.int8)
    return q.reshape(a.shape), scales


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16's 16-bit patterns, rounded to nearest even (torch's cast; finite inputs)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16
    return rounded.astype(np.uint16).view(np.int16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16's 16-bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode(a: np.ndarray, code: int) -> pb.Tensor:
    """A float array -> message as wire dtype `code` (cast, or row-quantized for int8)."""
    check_wire(code)
    if code == INT8:
        q, scales = quantize_rows(a)
        return encode_raw(q, INT8, scales)
    if code == BF16:
        return encode_raw(to_bf16_bits(a), BF16)
    return encode_raw(a.astype(_STORED[code], copy=False), code)


def encode_raw(stored: np.ndarray, code: int, scales: np.ndarray | None = None) -> pb.Tensor:
    """An array already in the wire's stored form (bf16 as int16 bits; int8 with its float32 scales)."""
    data = np.ascontiguousarray(stored).tobytes()
    msg = pb.Tensor(dtype=code, shape=list(stored.shape), data=data)  # type: ignore[arg-type]
    if scales is not None:
        msg.scales = np.ascontiguousarray(scales, dtype=np.float32).tobytes()
    return msg


def payload_bytes(msg: pb.Tensor) -> int:
    """The tensor bytes a message carries (values and int8 scales; 0 for an unset field)."""
    return len(msg.data) + len(msg.scales)


def decode(msg: pb.Tensor, spec: TensorSpec | None = None) -> np.ndarray:
    """Message -> array, validated against `spec`: float32 for fp32, bf16 and int8, float16 for fp16.
    The result owns its memory (writable)."""
    stored, code = decode_stored(msg, spec)
    return from_bf16_bits(stored) if code == BF16 else stored


def decode_stored(msg: pb.Tensor, spec: TensorSpec | None = None) -> tuple[np.ndarray, int]:
    """Message -> (array in its stored form, wire dtype), validated: bf16 stays its int16 bit patterns
    (codec.py views them as torch.bfloat16), int8 arrives dequantized to float32."""
    code = check_wire(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"negative dimension in shape {shape}")
    if spec is not None:
        check_shape(shape, spec)
    stored = _STORED[code]
    numel = 1
    for d in shape:
        numel *= d
    data = msg.data  # read once: every read of a bytes field copies it out of the message
    if len(data) != numel * stored.itemsize:
        raise TensorError(
            f"tensor of shape {shape} and {stored.itemsize}-byte elements needs {numel * stored.itemsize} bytes, "
            f"got {len(data)}"
        )
    limit = spec.max_bytes if spec else DEFAULT_MAX_BYTES
    if len(data) > limit:
        raise TensorError(f"tensor of {len(data)} bytes exceeds the {limit}-byte limit")
    array = np.frombuffer(bytearray(data), dtype=stored).reshape(shape) if numel else np.empty(shape, dtype=stored)
    if code == INT8:
        array = _dequantize(array, msg.scales, shape)
    elif msg.scales:
        raise TensorError("scales are only sent with int8 tensors")
    if numel and not _finite(array, code):
        raise TensorError("tensor has NaN or Inf values")
    return array, code


def _finite(array: np.ndarray, code: int) -> bool:
    if code == BF16:  # exponent bits all ones: Inf or NaN
        return not bool(((array.view(np.uint16) & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(peak_abs(array)))


def _dequantize(q: np.ndarray, scales: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """int8 values and their per-row float32 scales -> float32, checking the scales like any tensor."""
    rows = q.size // (shape[-1] if shape else 1) if q.size else 0
    if len(scales) != rows * 4:
        raise TensorError(
            f"int8 tensor of shape {shape} needs {rows} float32 scales ({rows * 4} bytes), got {len(scales)}"
        )
    if not rows:
        return np.empty(shape, dtype=np.float32)
    scale = np.frombuffer(scales, dtype="<f4")
    if not bool((np.isfinite(scale) & (scale > 0)).all()):
        raise TensorError("int8 scales must be finite and positive")
    return (q.reshape(rows, -1).astype(np.float32) * scale[:, None]).reshape(shape)


def check_shape(shape: tuple[int, ...], spec: TensorSpec) -> None:
    if len(shape) != len(spec.shape):
        raise TensorError(f"expected a rank-{len(spec.shape)} tensor {_fmt(spec.shape)}, got shape {shape}")
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if want is not None and got != want:
            raise TensorError(f"dim {axis} is {got}, expected {want} (shape {_fmt(spec.shape)}, got {shape})")
        if axis and want is None and got == 0:  # a free length (text's tokens): nothing to compute on
            raise TensorError(f"dim {axis} is 0 (shape {_fmt(spec.shape)}, got {shape})")
    if shape and spec.shape[0] is None and not 1 <= shape[0] <= spec.max_batch:
        raise TensorError(f"batch size {shape[0]} outside 1..{spec.max_batch}")


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("B" if d is None else str(d) for d in shape) + ")"
