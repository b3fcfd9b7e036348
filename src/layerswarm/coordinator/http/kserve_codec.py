"""Open Inference Protocol (KServe v2) REST bodies: JSON tensors and the binary tensor extension.

A request body is JSON, or (binary extension) JSON of `Inference-Header-Content-Length` bytes followed
by the raw tensors, in input order, of every input whose parameters carry `binary_data_size`. BYTES
elements travel as a 4-byte little-endian length and the bytes; in JSON they are base64 strings (an
encoded image is rarely valid UTF-8). Everything is checked against the declared shape before use;
only FP32, INT64 and BYTES are read.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bodies import parse_json_object
from .errors import ApiError

NUMERIC: dict[str, np.dtype[Any]] = {"FP32": np.dtype("<f4"), "INT64": np.dtype("<i8")}
MAX_ELEMENTS = 64 * 1024 * 1024  # far above any batch we accept; stops absurd shapes before allocation
# Our inputs have at most 4 dimensions. Checked before the product of the dimensions, which costs time
# quadratic in their number (40,000 of 19 digits: 5 s on the event loop), and before any error echoes them.
MAX_DIMS = 8


class ProtocolError(ValueError):
    """A request that does not follow the protocol: the API answers 400 with this message."""


@dataclass
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray | None = None  # numeric inputs
    items: list[bytes] = field(default_factory=list)  # BYTES inputs, flattened


@dataclass
class RequestedOutput:
    name: str
    binary: bool
    classification: int = 0  # the classification extension: top-k as "score:index:label"


@dataclass
class InferRequest:
    id: str | None
    parameters: dict[str, Any]
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None  # None: all outputs
    binary_output: bool  # the default for outputs that do not say


def parse_request(body: bytes, header_length: int | None) -> InferRequest:
    if header_length is not None and not 0 < header_length <= len(body):
        raise ProtocolError(f"Inference-Header-Content-Length {header_length} outside the body of {len(body)} bytes")
    head, binary = (body, b"") if header_length is None else (body[:header_length], body[header_length:])
    try:
        doc = parse_json_object(head)  # the front door's strict decoder: nesting, huge numbers, NaN -> 400
    except ApiError as exc:
        # KServe's binary extension calls the JSON part the inference header; a plain request is all JSON
        part = "the JSON inference header" if header_length is not None else "the request body"
        raise ProtocolError(f"{part}: {exc.detail}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise ProtocolError("request must be a JSON object with a non-empty `inputs` list")
    params = _object(doc.get("parameters", {}), "parameters")
    offset = 0
    inputs = []
    for index, raw in enumerate(doc["inputs"]):
        tensor, offset = _input(_object(raw, f"inputs[{index}]"), binary, offset)
        inputs.append(tensor)
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data left over after the declared inputs")
    outputs = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise ProtocolError("`outputs` must be a list")
        outputs = [_requested(_object(o, f"outputs[{i}]"), params) for i, o in enumerate(doc["outputs"])]
    request_id = doc.get("id")
    return InferRequest(
        id=request_id if isinstance(request_id, str) else None,
        parameters=params,
        inputs=inputs,
        outputs=outputs,
        binary_output=params.get("binary_data_output") is True,
    )


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be a JSON object")
    return value


def _requested(raw: dict[str, Any], params: dict[str, Any]) -> RequestedOutput:
    if not isinstance(raw.get("name"), str):
        raise ProtocolError("every requested output needs a `name`")
    out_params = _object(raw.get("parameters", {}), f"parameters of output {raw['name']}")
    binary = out_params.get("binary_data", params.get("binary_data_output", False))
    classification = out_params.get("classification", 0)
    if not isinstance(classification, int) or isinstance(classification, bool) or not 0 <= classification <= 1000:
        raise ProtocolError("output parameter `classification` must be an integer from 0 to 1000")
    return RequestedOutput(raw["name"], binary is True, classification)


def _input(raw: dict[str, Any], binary: bytes, offset: int) -> tuple[InputTensor, int]:
    name, datatype, shape = raw.get("name"), raw.get("datatype"), raw.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise ProtocolError("every input needs a `name` and a `datatype`")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"input {name}: `shape` must be a list of at most {MAX_DIMS} dimensions")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"input {name}: `shape` must be a list of non-negative integers")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ProtocolError(f"input {name}: shape {shape} is too large")
    size = _object(raw.get("parameters", {}), f"parameters of input {name}").get("binary_data_size")
    tensor = InputTensor(name, datatype, tuple(shape))
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(binary) - offset:
            raise ProtocolError(f"input {name}: binary_data_size {size} exceeds the binary data sent")
        _fill_binary(tensor, binary[offset : offset + size], count)
        return tensor, offset + size
    if "data" not in raw:
        raise ProtocolError(f"input {name} has neither `data` nor a binary_data_size")
    _fill_json(tensor, raw["data"], count)
    return tensor, offset


def _fill_binary(tensor: InputTensor, raw: bytes, count: int) -> None:
    if tensor.datatype == "BYTES":
        tensor.items = _split_bytes(raw, tensor.name)
    elif tensor.datatype in NUMERIC:
        dtype = NUMERIC[tensor.datatype]
        if len(raw) != count * dtype.itemsize:
            shape = list(tensor.shape)
            raise ProtocolError(f"input {tensor.name}: {len(raw)} bytes for {tensor.datatype} of shape {shape}")
        tensor.array = np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)
    else:
        raise ProtocolError(f"input {tensor.name}: datatype {tensor.datatype} not supported (FP32, INT64 or BYTES)")
    if tensor.datatype == "BYTES" and len(tensor.items) != count:
        raise ProtocolError(f"input {tensor.name}: {len(tensor.items)} elements for shape {list(tensor.shape)}")


def _split_bytes(raw: bytes, name: str) -> list[bytes]:
    items, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise ProtocolError(f"input {name}: truncated BYTES element length")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise ProtocolError(f"input {name}: BYTES element of {length} bytes runs past the data")
        items.append(raw[pos : pos + length])
        pos += length
    return items


def _fill_json(tensor: InputTensor, data: Any, count: int) -> None:
    if tensor.datatype == "BYTES":
        flat = _flatten(data)
        if len(flat) != count or not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"input {tensor.name}: BYTES data must be {count} base64 strings")
        try:
            tensor.items = [base64.b64decode(v, validate=True) for v in flat]
        except (binascii.Error, ValueError) as exc:
            raise ProtocolError(f"input {tensor.name}: BYTES data is not base64: {exc}") from exc
        return
    if tensor.datatype not in NUMERIC:
        raise ProtocolError(f"input {tensor.name}: datatype {tensor.datatype} not supported (FP32, INT64 or BYTES)")
    flat = _flatten(data)
    if len(flat) != count or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise ProtocolError(f"input {tensor.name}: data must be {count} numbers for shape {list(tensor.shape)}")
    tensor.array = np.asarray(flat, dtype=NUMERIC[tensor.datatype]).reshape(tensor.shape)


def _flatten(data: Any) -> list[Any]:
    """Row-major flattening of nested lists (the protocol allows either form)."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


@dataclass
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray | None = None
    items: list[bytes] = field(default_factory=list)


def encode_response(doc: dict[str, Any], outputs: list[tuple[OutputTensor, bool]]) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when any output travels as binary."""
    tensors, chunks = [], []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if binary:
            raw = _raw(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif tensor.datatype == "BYTES":
            entry["data"] = [item.decode("utf-8", "replace") for item in tensor.items]
        else:
            assert tensor.array is not None
            entry["data"] = tensor.array.reshape(-1).tolist()
        tensors.append(entry)
    head = json.dumps({**doc, "outputs": tensors}).encode()
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)


def _raw(tensor: OutputTensor) -> bytes:
    if tensor.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in tensor.items)
    assert tensor.array is not None
    return np.ascontiguousarray(tensor.array, dtype=NUMERIC[tensor.datatype]).tobytes()
