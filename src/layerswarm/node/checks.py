"""What a node refuses before and after computing, shared by Forward (service.py) and Decode (decode.py).

A refusal is a RequestError carrying the gRPC status to answer with: INVALID_ARGUMENT for what the
sender got wrong (shape, dtype, non-finite or out-of-range values), INTERNAL for an output this node
must not send.
"""

from __future__ import annotations

import math

import grpc
import numpy as np

from layerswarm.wire import arrays
from layerswarm.wire.v1 import block_pb2 as pb

# An input whose largest value is past this fraction of the reply dtype's limit leaves a block no room
# (a residual block adds to its input): it is refused as the sender's fault, before any compute. The
# coordinator applies the same bound to every reply (coordinator/verification/ranges.py: hard_range_problem).
INPUT_HEADROOM = 0.5


class RequestError(Exception):
    """A request the node refuses; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# Wire dtype codes (wire/arrays.py: FP32, FP16, BF16, INT8) by the names torch gives them in messages.
_DTYPE_NAMES = {arrays.FP32: "float32", arrays.FP16: "float16", arrays.BF16: "bfloat16", arrays.INT8: "int8"}


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES[code]


def output_problem(out: np.ndarray, reply_dtype: int) -> str | None:
    """Why `out` must not be sent as wire dtype `reply_dtype`, or None when it can be."""
    peak = arrays.peak_abs(out) if out.size else 0.0
    if not math.isfinite(peak):
        return "has NaN or Inf values"
    limit = arrays.value_limit(reply_dtype)
    if peak > limit:
        return f"is out of range for {dtype_name(reply_dtype)} (max |x| {peak:.4g} > {limit:.6g})"
    return None


def reply_dtype_of(asked: int, sent: int) -> int:
    """The reply's wire dtype: the one asked for, else the request's own (int8 in, int8 back: the link is
    as slow both ways)."""
    try:
        return arrays.check_wire(sent if asked == pb.DTYPE_UNSPECIFIED else asked)
    except arrays.TensorError as exc:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"activations: {exc}") from exc


def decoded(msg: pb.Tensor, spec: arrays.TensorSpec, what: str) -> np.ndarray:
    """An array from the wire, checked against `spec` (arrays.decode); its faults are INVALID_ARGUMENT."""
    try:
        return arrays.decode(msg, spec)
    except arrays.TensorError as exc:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {exc}") from exc


def check_input_range(x: np.ndarray, reply_dtype: int, what: str = "input activations") -> None:
    """Refuse an input too large for the block to add to and still fit the reply dtype."""
    limit = arrays.value_limit(reply_dtype) * INPUT_HEADROOM
    peak = arrays.peak_abs(x) if x.size else 0.0
    if peak > limit:  # the sender's output was already wrong: say so, rather than overflow and be blamed
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} out of range: max |x| {peak:.6g} > {limit:.6g} "
            f"(half the {dtype_name(reply_dtype)} limit); the previous hop's output is suspect",
        )
