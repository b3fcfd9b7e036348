"""The one tensor codec: torch.Tensor <-> layerswarm.v1.Tensor, with validation at every boundary.

Bytes are little-endian and C-contiguous; bfloat16 travels as its raw 16-bit pattern. `int8` is the
compact form for slow links: symmetric int8 with one float32 scale per row of the last dimension (per
token of a B x T x D activation), a quarter of fp32's bytes plus 4 bytes a token; it decodes to
float32. Decoding never trusts the sender: dtype, rank, shape, byte count, size limit, scales and
finiteness are all checked, and a violation raises TensorError with a message fit to send back as
INVALID_ARGUMENT or HTTP 4xx.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .v1 import block_pb2 as pb

# torch.int8 names the row-scaled int8 wire format: encode quantizes to it, decode dequantizes from it.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int8: pb.DTYPE_INT8,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

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


def dtype_by_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}: choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name `dtype_by_name` takes (fp16 for torch.float16)."""
    return next(name for name, d in DTYPES.items() if d is dtype)


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise TensorError(f"dtype {dtype} cannot travel; use one of {', '.join(DTYPES)}") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise TensorError(f"unsupported wire dtype {wire}; expected fp32, fp16, bf16 or int8") from None


def value_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a wire dtype carries (row-scaled int8: whatever float32 scales carry)."""
    return float(torch.finfo(torch.float32 if dtype == torch.int8 else dtype).max)


def decoded_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decode() returns for a wire dtype: int8 arrives dequantized to float32."""
    return torch.float32 if dtype == torch.int8 else dtype


def as_sent(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the receiver of `t` sent as `dtype` decodes, as float32 (the cast's or quantization's rounding)."""
    if dtype == torch.int8:
        q, scales = quantize_rows(t.detach().cpu())
        return q.to(torch.float32) * scales.reshape(*t.shape[:-1], 1) if t.numel() else q.to(torch.float32)
    return t.to(dtype).float()


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale per row of the last dim); a zero row gets scale 1."""
    width = t.shape[-1] if t.dim() else 1
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=torch.int8), torch.empty(0)
    rows = t.to(torch.float32).reshape(-1, width)
    scales = rows.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(t.shape), scales


def encode(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> pb.Tensor:
    """Tensor -> message (raw bytes). Casts to `dtype` first when given (e.g. fp16 on the wire)."""
    t = tensor.detach()
    if dtype == torch.int8 or (dtype is None and t.dtype == torch.int8):
        q, scales = quantize_rows(t.cpu())
        shape = list(q.shape)
        return pb.Tensor(dtype=pb.DTYPE_INT8, shape=shape, data=_bytes(q), scales=_bytes(scales))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.cpu().contiguous()
    code = wire_dtype(t.dtype)
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return pb.Tensor(dtype=code, shape=list(t.shape), data=_bytes(raw))  # type: ignore[arg-type]


def encode_sent(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[pb.Tensor, torch.Tensor]:
    """(the message, what its receiver decodes as float32): `encode` and `as_sent` in one quantization."""
    t = tensor.detach().cpu()
    if dtype != torch.int8:
        return encode(t, dtype), t.to(dtype).float()
    q, scales = quantize_rows(t)
    msg = pb.Tensor(dtype=pb.DTYPE_INT8, shape=list(q.shape), data=_bytes(q), scales=_bytes(scales))
    sent = q.to(torch.float32) * scales.reshape(*t.shape[:-1], 1) if t.numel() else q.to(torch.float32)
    return msg, sent


def payload_bytes(msg: pb.Tensor) -> int:
    """The tensor bytes a message carries (values and int8 scales; 0 for an unset field)."""
    return len(msg.data) + len(msg.scales)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def decode(msg: pb.Tensor, spec: TensorSpec | None = None) -> torch.Tensor:
    """Message -> tensor, validated against `spec`. The result owns its memory (writable)."""
    dtype = torch_dtype(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"negative dimension in shape {shape}")
    if spec is not None:
        check_shape(shape, spec)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    data = msg.data  # read once: every read of a bytes field copies it out of the message
    if len(data) != numel * itemsize:
        raise TensorError(
            f"tensor of shape {shape} and {itemsize}-byte elements needs {numel * itemsize} bytes, got {len(data)}"
        )
    limit = spec.max_bytes if spec else DEFAULT_MAX_BYTES
    if len(data) > limit:
        raise TensorError(f"tensor of {len(data)} bytes exceeds the {limit}-byte limit")
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    tensor = (
        torch.frombuffer(bytearray(data), dtype=raw_dtype).reshape(shape)
        if numel
        else torch.empty(shape, dtype=raw_dtype)
    )
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    if dtype == torch.int8:
        tensor = _dequantize(tensor, msg.scales, shape)
    elif msg.scales:
        raise TensorError("scales are only sent with int8 tensors")
    if numel and not math.isfinite(peak_abs(tensor)):
        raise TensorError("tensor has NaN or Inf values")
    return tensor


def peak_abs(t: torch.Tensor) -> float:
    """The largest |value| of a non-empty tensor: NaN or Inf when any value is (aminmax propagates NaN).
    One pass with no temporary, unlike isfinite().all() (a bool tensor first) or abs().amax() (|t|
    first)."""
    low, high = torch.aminmax(t)
    return max(-float(low), float(high))


def _dequantize(q: torch.Tensor, scales: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """int8 values and their per-row float32 scales -> float32, checking the scales like any tensor."""
    rows = q.numel() // (shape[-1] if shape else 1) if q.numel() else 0
    if len(scales) != rows * 4:
        raise TensorError(
            f"int8 tensor of shape {shape} needs {rows} float32 scales ({rows * 4} bytes), got {len(scales)}"
        )
    scale = torch.frombuffer(bytearray(scales), dtype=torch.float32) if rows else torch.empty(0)
    if rows and not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise TensorError("int8 scales must be finite and positive")
    if not rows:
        return torch.empty(shape, dtype=torch.float32)
    return (q.reshape(rows, -1).to(torch.float32) * scale[:, None]).reshape(shape)


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
