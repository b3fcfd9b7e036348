"""The tensor codec's torch face: torch.Tensor <-> layerswarm.v1.Tensor, for the coordinator and the torch engine.

The format itself (bytes, shapes, int8 scales, every check on what a sender sent) is `arrays.py`, which
needs only numpy, so a node without torch speaks the same wire. Here: torch's dtypes, its casts (to
fp16, bf16), and row-scaled int8 quantization in torch, all producing the same bytes as arrays.py.

Bytes are little-endian and C-contiguous; bfloat16 travels as its raw 16-bit pattern. `int8` is the
compact form for slow links: symmetric int8 with one float32 scale per row of the last dimension (per
token of a B x T x D activation), a quarter of fp32's bytes plus 4 bytes a token; it decodes to
float32. Decoding never trusts the sender (arrays.decode_stored), and a violation raises TensorError
with a message fit to send back as INVALID_ARGUMENT or HTTP 4xx.
"""

from __future__ import annotations

import torch

from . import arrays
from .arrays import DEFAULT_MAX_BYTES, TensorError, TensorSpec, check_shape, payload_bytes
from .v1 import block_pb2 as pb

__all__ = ["DEFAULT_MAX_BYTES", "TensorError", "TensorSpec", "check_shape", "payload_bytes"]

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
        return arrays.encode_raw(q.numpy(), pb.DTYPE_INT8, scales.numpy())
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.cpu().contiguous()
    code = wire_dtype(t.dtype)
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return arrays.encode_raw(raw.numpy(), code)


def encode_sent(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[pb.Tensor, torch.Tensor]:
    """(the message, what its receiver decodes as float32): `encode` and `as_sent` in one quantization."""
    t = tensor.detach().cpu()
    if dtype != torch.int8:
        return encode(t, dtype), t.to(dtype).float()
    q, scales = quantize_rows(t)
    msg = arrays.encode_raw(q.numpy(), pb.DTYPE_INT8, scales.numpy())
    sent = q.to(torch.float32) * scales.reshape(*t.shape[:-1], 1) if t.numel() else q.to(torch.float32)
    return msg, sent


def decode(msg: pb.Tensor, spec: TensorSpec | None = None) -> torch.Tensor:
    """Message -> tensor, validated against `spec` (arrays.decode_stored). The result owns its memory
    (writable)."""
    stored, code = arrays.decode_stored(msg, spec)
    tensor = torch.from_numpy(stored)
    return tensor.view(torch.bfloat16) if code == pb.DTYPE_BFLOAT16 else tensor


def peak_abs(t: torch.Tensor) -> float:
    """The largest |value| of a non-empty tensor: NaN or Inf when any value is (aminmax propagates NaN).
    One pass with no temporary, unlike isfinite().all() (a bool tensor first) or abs().amax() (|t|
    first)."""
    low, high = torch.aminmax(t)
    return max(-float(low), float(high))
